#!/usr/bin/env python3
"""Benchmark the model runtime against transformers' own forward, side by side in one run.

For each dtype: prefill throughput (tokens/s over a batch of prompts) and the
time of one batched decode step at several batch sizes, each measured for
our paged varlen `Decoder.forward` and for transformers' `LlamaForCausalLM`
(sdpa attention, DynamicCache) on the same weights and the same inputs.
Repeats are interleaved (ours, theirs, ours, ...) and medians reported, with
the ratio theirs/ours (above 1 means we are faster).

    python scripts/bench_model.py                      # default model, bf16 and fp32
    python scripts/bench_model.py --random --device cuda --dtypes bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrox_batch.bench.batcher import default_model  # noqa: E402
from ferrox_batch.runtime.architectures.decoder import Decoder  # noqa: E402
from ferrox_batch.runtime.config import ModelConfig  # noqa: E402
from ferrox_batch.runtime.device import DTYPES, choose_device  # noqa: E402
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk  # noqa: E402

SMOLLM2_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "hidden_act": "silu",
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def load_pair(args: argparse.Namespace, dtype: torch.dtype, device: torch.device):
    import transformers

    if args.random:
        raw = dict(SMOLLM2_SHAPE)
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**raw)).eval()
    else:
        folder = Path(args.model).expanduser()
        raw = json.loads((folder / "config.json").read_text())
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    weights = {k: v.detach() for k, v in ref.state_dict().items()}
    ours = Decoder(ModelConfig.from_dict(raw), weights, device=device, dtype=dtype)
    ref = ref.to(device=device, dtype=dtype)
    ref.config._attn_implementation = "sdpa"
    return ours, ref


def time_it(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def bench_prefill(ours: Decoder, ref, device, batch: int, length: int, repeats: int) -> tuple[float, float]:
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (batch, length), generator=gen)
    lists = prompts.tolist()
    ids = prompts.to(device)
    t_ours, t_ref = [], []
    for _ in range(repeats):
        store = ours.new_store(256, num_blocks=batch * (length // 256 + 2))
        for i in range(batch):
            store.add_sequence(i, length)
        t_ours.append(time_it(lambda: ours.forward([SeqChunk(i, lists[i]) for i in range(batch)], store), device))
        with torch.inference_mode():
            t_ref.append(time_it(lambda: ref(ids, past_key_values=DynamicCache(), use_cache=True), device))
    tokens = batch * length
    return tokens / statistics.median(t_ours), tokens / statistics.median(t_ref)


def bench_decode(ours: Decoder, ref, device, batch: int, context: int, steps: int) -> tuple[float, float]:
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, 40000, (batch, context), generator=gen)
    lists = prompts.tolist()
    store = ours.new_store(256, num_blocks=batch * ((context + steps) // 256 + 2))
    for i in range(batch):
        store.add_sequence(i, context + steps + 1)
    ours.forward([SeqChunk(i, lists[i]) for i in range(batch)], store)
    with torch.inference_mode():
        cache = DynamicCache()
        ref(prompts.to(device), past_key_values=cache, use_cache=True)
    nxt = torch.randint(100, 40000, (steps, batch), generator=gen)
    t_ours, t_ref = [], []
    for s in range(steps):
        row = nxt[s].tolist()
        t_ours.append(time_it(lambda: ours.forward([SeqChunk(i, [row[i]]) for i in range(batch)], store), device))
        step_ids = nxt[s].to(device)[:, None]
        with torch.inference_mode():
            t_ref.append(time_it(lambda: ref(step_ids, past_key_values=cache, use_cache=True), device))
    warm = max(1, steps // 4)  # the first steps pay for kernel selection
    return statistics.median(t_ours[warm:]), statistics.median(t_ref[warm:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model(os.environ))
    parser.add_argument("--random", action="store_true", help="random weights of SmolLM2-135M's shape")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=128, help="positions already cached when decoding")
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per batch size")
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    device = choose_device(args.device)
    print(f"# bench_model: torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"{'random weights' if args.random else args.model}")
    print("| dtype | measure | ours | transformers | transformers/ours |")
    print("|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name.strip()]
        ours, ref = load_pair(args, dtype, device)
        bench_prefill(ours, ref, device, 1, 32, 1)  # warm-up
        p_ours, p_ref = bench_prefill(ours, ref, device, args.prefill_batch, args.prefill_len, args.repeats)
        print(f"| {name} | prefill tok/s ({args.prefill_batch}x{args.prefill_len}) | {p_ours:,.0f} | "
              f"{p_ref:,.0f} | {p_ref / p_ours:.2f} (higher is theirs) |", flush=True)
        for batch in (int(b) for b in args.batches.split(",")):
            d_ours, d_ref = bench_decode(ours, ref, device, batch, args.context, args.steps)
            print(f"| {name} | decode step ms, batch {batch} (ctx {args.context}) | {d_ours * 1e3:.1f} | "
                  f"{d_ref * 1e3:.1f} | {d_ref / d_ours:.2f} |", flush=True)
        del ours, ref
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
