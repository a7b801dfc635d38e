#!/usr/bin/env python3
"""Where a mixture-of-experts decode step's time goes, and how near it is to the bytes-read roofline.

In process, on one GGUF (or checkpoint folder) served as `load_model` serves it: a prompt prefilled, then
`--steps` single-stream decode steps timed one by one (median), then the same steps again with each MoE
block's phases timed apart: the router (its float32 product, softmax and top-k), the gather (sorting the
(row, expert) pairs and gathering their rows), the expert products (each expert's gate/up and down), the
scatter (the weighted `index_add_`), and everything else (attention, norms, the head). Synchronous timers
only add Python between the phases, so that pass runs apart from the timed one.

The roofline: the bytes a one-row step must read (every non-expert weight the step multiplies by, the
head included; the k chosen experts of each sparse layer, at the file's bytes; one embedding row), over
this machine's memory bandwidth, measured here as the median of timed reads of a buffer far larger than
the caches (`--buffer-gib`). It prints the step's tok/s, the roofline's, and their ratio.

    python scripts/bench_moe.py ~/.cache/ferrox-batch/bench-models/qwen3-30b-a3b-shaped-8l-q8_0.gguf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferrox_batch.runtime.architectures import moe as moe_module  # noqa: E402
from ferrox_batch.runtime.architectures.moe import MoeBlock  # noqa: E402
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk  # noqa: E402
from ferrox_batch.runtime.kv.paged_kv import model_groups  # noqa: E402
from ferrox_batch.runtime.loading.loader import load_model  # noqa: E402


def bandwidth(gib: float, rounds: int = 7) -> float:
    """Bytes per second one pass of reads over a `gib` GiB buffer reaches (median of `rounds`), on torch's
    threads: a sum over int64 words, which the CPU streams at the memory's pace."""
    words = torch.ones(int(gib * 2**30) // 8, dtype=torch.int64)
    words.sum()
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        words.sum()
        times.append(time.perf_counter() - began)
    return words.numel() * 8 / statistics.median(times)


def step_bytes(decoder: object) -> int:
    """The weight bytes a one-row decode step reads: every layer's linears but the experts not chosen (k of
    each sparse layer's, at their mean size), the norms and routers, the head (the embedding counted once
    where the head is tied: one row of it is read besides)."""
    total = 0
    for layer in decoder.layers:
        ffn = layer.ffn
        total += layer.mixer.nbytes + sum(t.numel() * t.element_size() for t in layer.norms())
        if isinstance(ffn, MoeBlock):
            experts = sum(g.nbytes + d.nbytes for g, d in zip(ffn.gate_up, ffn.down))
            total += experts * ffn.router.top_k // ffn.router.experts
            total += ffn.router_weight.numel() * 4 + (0 if ffn.shared is None else ffn.shared.nbytes)
        else:
            total += ffn.nbytes
    total += decoder.lm_head.nbytes + decoder.final_norm.numel() * decoder.final_norm.element_size()
    return total


def decode_times(model: object, prompt: list[int], steps: int,
                 prefilled: Callable[[], object] | None = None) -> list[float]:
    """`steps` single-row decode steps' seconds after a prefill of `prompt` (`prefilled` is called between)."""
    # every KV group (gpt-oss's sliding layers and its full ones) holds the sequence's positions in blocks of its own
    groups = len(model_groups(model.config).layers)
    store = model.decoder.new_store(16, num_blocks=groups * ((len(prompt) + steps) // 16 + 2))
    store.add_sequence(0, len(prompt) + steps)
    logits = model.decoder.forward([SeqChunk(0, prompt)], store)
    token = int(logits[0].argmax())
    if prefilled is not None:
        prefilled()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        logits = model.decoder.forward([SeqChunk(0, [token])], store)
        token = int(logits[0].argmax())
        times.append(time.perf_counter() - began)
    return times


class PhaseTimer:
    """Replaces `MoeBlock.forward` with the same arithmetic, timed phase by phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def __enter__(self) -> PhaseTimer:
        self._original = MoeBlock.forward
        timer = self

        def forward(block: MoeBlock, x: torch.Tensor, ctx: object) -> torch.Tensor:
            t0 = time.perf_counter()
            rows, k = x.shape[0], block.router.top_k
            x32 = x.float()
            if block.plain_router and ctx.kernels is not None:  # the C router, as the block runs it
                weights, ids = ctx.kernels.moe_route(x, block.router_weight, block.router.top_k, block.router.renormalize)
            else:
                weights, ids = moe_module.route(torch.nn.functional.linear(x32, block.router_weight,
                                                                           block.router_bias), block.router,
                                                block.correction)
            t1 = time.perf_counter()
            flat = ids.flatten()
            order = flat.argsort(stable=True)
            source = order // k
            counts = torch.bincount(flat, minlength=block.router.experts).tolist()
            gathered = x[source]
            t2 = time.perf_counter()
            if block.packed is not None and ctx.kernels is not None:  # every expert in one call per projection
                counts_t = torch.tensor(counts, dtype=torch.int64)
                hi = counts_t.cumsum(0)
                gate_up, down = block.packed
                results = down(ctx.kernels.silu_mul(gate_up(gathered, hi - counts_t, hi)), hi - counts_t, hi).float()
            else:
                results = torch.empty(rows * k, x.shape[1], dtype=torch.float32)
                end = 0
                for expert, count in enumerate(counts):
                    if count:
                        results[end:end + count] = block.down[expert](block.gate_up[expert](gathered[end:end + count]))
                    end += count
            t3 = time.perf_counter()
            results *= weights.flatten()[order, None]
            out = torch.zeros(rows, x.shape[1], dtype=torch.float32).index_add_(0, source, results)
            t4 = time.perf_counter()
            for name, seconds in (("router", t1 - t0), ("gather", t2 - t1), ("experts", t3 - t2),
                                  ("scatter", t4 - t3)):
                timer.seconds[name] += seconds
            assert block.shared is None and block.out_norm is None and block.expert_norm is None \
                and block.router_input_scale is None and block.expert_scale is None, \
                "the phase timer covers the routed experts only"
            return out.to(x.dtype)

        MoeBlock.forward = forward  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        MoeBlock.forward = self._original  # type: ignore[method-assign]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64, help="prompt length in tokens")
    p.add_argument("--buffer-gib", type=float, default=2.0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-stack", action="store_true", help="time the Python layer loop, not the C layer stack")
    p.add_argument("--per-expert", action="store_true",
                   help="run each expert's products in calls of their own (not every expert's in one call)")
    args = p.parse_args()
    model = load_model(args.model, dtype=args.dtype)
    if args.no_stack:
        model.decoder.layer_stack = None
    if args.per_expert:
        model.decoder.layer_stack = None
        for layer in model.decoder.layers:
            if isinstance(layer.ffn, MoeBlock):
                layer.ffn.packed = None
    together = any(isinstance(layer.ffn, MoeBlock) and layer.ffn.packed is not None for layer in model.decoder.layers)
    print(f"# experts run {'together, one call per projection' if together else 'one call each'}", flush=True)
    print(f"# {args.model.name}: {model.decoder.linear_kinds}; {torch.get_num_threads()} threads", flush=True)
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.prompt)]
    decode_times(model, prompt, 4)  # warm
    before = bandwidth(args.buffer_gib)
    times = decode_times(model, prompt, args.steps)
    step = statistics.median(times)
    # The phases are timed in the Python layer loop (the C layer stack runs a step in one call).
    stack, model.decoder.layer_stack = model.decoder.layer_stack, None
    loop_times = decode_times(model, prompt, args.steps)
    with PhaseTimer() as phases:
        timed = decode_times(model, prompt, args.steps, prefilled=phases.seconds.clear)  # the steps' phases only
    model.decoder.layer_stack = stack
    total = sum(timed)
    # The machine's bandwidth drifts (a shared host): measured either side of the steps, the higher taken.
    bw = max(before, bandwidth(args.buffer_gib))
    need = step_bytes(model.decoder)
    roof = bw / need
    print(f"decode step: median {step * 1e3:.1f} ms = {1 / step:.2f} tok/s over {args.steps} steps "
          f"({'the C layer stack' if stack is not None else 'the Python layer loop: ' + str(model.decoder.layer_stack_declined)}); "
          f"the Python layer loop's: {statistics.median(loop_times) * 1e3:.1f} ms")
    print(f"bytes per step {need / 2**20:.0f} MiB; bandwidth {bw / 1e9:.1f} GB/s (before the steps "
          f"{before / 1e9:.1f}); roofline {roof:.2f} tok/s; reached {1 / step / roof:.0%}")
    print("where a step's time goes (the Python loop's timed pass, its own total):")
    for name in ("router", "gather", "experts", "scatter"):
        print(f"  {name:8s} {phases.seconds[name] / args.steps * 1e3:7.2f} ms  {phases.seconds[name] / total:6.1%}")
    other = total - sum(phases.seconds.values())
    print(f"  {'other':8s} {other / args.steps * 1e3:7.2f} ms  {other / total:6.1%}  (attention, norms, head, Python)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
