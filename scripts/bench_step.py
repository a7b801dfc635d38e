#!/usr/bin/env python3
"""Where a single stream's decode step goes, in process: the model's forward, the sampling after it, and
the worker's own Python (scheduling, stop checks, the text streamed to the caller).

One request at a time through a `ContinuousBatcher` (greedy, EOS ignored), as a chat user's stream runs:
the decoder's `forward` is wrapped with a timer, and the worker's own totals (`engine.worker_time`) split
the rest. Per decode step, medians over the requests:

* `model forward`: `Decoder.forward` (the layers, the final norm, the lm head);
* `sampling and copies`: the rest of `Runner.execute` (the sampler, log-probabilities, host copies);
* `worker Python`: scheduling, `update()` with the stop checks, detokenization and the reply to the caller;
* `other`: the step's wall time left (the worker waiting for the caller's thread, the GIL).

    python scripts/bench_step.py --model ~/.cache/ferrox-batch/models/smollm2-135m-instruct --dtype bf16
    python scripts/bench_step.py --model ~/.cache/ferrox-batch/downloads/SmolLM2-135M-Instruct.Q8_0.gguf
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferrox_batch.admission.config import BatcherConfig  # noqa: E402
from ferrox_batch.bench.batcher import default_model  # noqa: E402
from ferrox_batch.engine.handle import ContinuousBatcher  # noqa: E402
from ferrox_batch.generation_types import GenerationParams  # noqa: E402
from ferrox_batch.runtime.architectures.layer_stack import NARROW_STEP_ROWS, LayerStack  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402


def stack_state(stack: LayerStack | None) -> str:
    """Whether the layer stack runs the measured steps: every one, none, or (a narrow-only stack) those of at
    most `NARROW_STEP_ROWS` rows, which a single stream's decode steps are."""
    if stack is None:
        return "off"
    return f"on for steps of up to {NARROW_STEP_ROWS} rows" if stack.narrow_only else "on"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(os.environ))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights", default="auto")
    p.add_argument("--batch-invariant", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--requests", type=int, default=4)
    args = p.parse_args()

    model = load_model(args.model, device="cpu", dtype=args.dtype, weights=args.weights,
                       batch_invariant=args.batch_invariant)
    decoder = model.decoder
    spent = [0.0]
    depth = [0]  # `forward_every` may call `forward`: time the outer call only
    for name in ("forward", "forward_every"):
        inner = getattr(decoder, name)

        def timed(*a, _inner=inner, **kw):
            began = time.perf_counter()
            depth[0] += 1
            try:
                return _inner(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - began

        setattr(decoder, name, timed)
    vocab = model.config.vocab_size
    rows = {"step": [], "model forward": [], "sampling and copies": [], "worker Python": [], "other": []}
    params = GenerationParams(max_tokens=args.tokens, ignore_eos=True)
    with ContinuousBatcher.from_model(model, BatcherConfig(kv_block_size=16, kv_blocks=512)) as batcher:
        for request in range(args.requests + 1):  # the first warms the kernels and caches
            prompt = [(7919 * (i + 1) * (request + 3)) % (vocab - 10) + 5 for i in range(args.prompt_tokens)]
            marks: list[float] = []
            start: dict[str, float] = {}

            def on_chunk(_text: str) -> None:
                now = time.perf_counter()
                marks.append(now)
                if len(marks) == 1:  # the first token's time: the decode steps start here
                    before = batcher.stats()
                    start.update(forward=before.worker_forward_ms, scheduling=before.worker_scheduling_ms,
                                 model=spent[0], at=now)

            result = batcher.generate_streaming(prompt, params, None, on_chunk)
            after = batcher.stats()
            end = time.perf_counter()
            steps = len(result.token_ids) - 1
            if request == 0 or steps < 1 or not start:
                continue
            wall = (end - start["at"]) / steps * 1e3
            forward = (after.worker_forward_ms - start["forward"]) / steps
            model_ms = (spent[0] - start["model"]) / steps * 1e3
            scheduling = (after.worker_scheduling_ms - start["scheduling"]) / steps
            rows["step"].append(wall)
            rows["model forward"].append(model_ms)
            rows["sampling and copies"].append(forward - model_ms)
            rows["worker Python"].append(scheduling)
            rows["other"].append(wall - forward - scheduling)
    print(f"{Path(args.model).name}: {model.precision}, linear kernels {model.decoder.linear_kinds}, "
          f"layer stack {stack_state(model.decoder.layer_stack)}, batch-invariant "
          f"{'yes' if model.batch_invariant else 'no'}")
    step = statistics.median(rows["step"])
    print(f"| per decode step | ms | share |\n|---|---|---|")
    for name, values in rows.items():
        value = statistics.median(values)
        print(f"| {name} | {value:.2f} | {value / step:.0%} |")
    print(f"decode {1e3 / step:.1f} tok/s (median of {len(rows['step'])} requests of {args.tokens} tokens after a "
          f"{args.prompt_tokens}-token prompt)")


if __name__ == "__main__":
    main()
