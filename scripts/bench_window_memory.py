"""The KV memory hybrid window groups save: bytes per row and rows a pool admits, before and after.

For Gemma 3 270M's shape (18 layers, 15 local with a 512-position window and 3 global; 1 KV head of 256;
blocks of 16) and the tests' tiny Gemma 3 (3 layers, 2 local with window 6), built from a config dict (no
weights), prints for rows of prompt + max_tokens = 1k, 4k, 8k and 32k positions: the KV bytes one row
holds at once and the rows a pool of `--pool-gib` admits, with every layer holding every position (the
store before KV groups) and with hybrid groups (`admission.kv_groups`: the local groups priced at their
hold bound). Pure arithmetic, the ledger's own: `GroupPricing.hold` and `PagedKvStore.bytes_per_block`.

    python scripts/bench_window_memory.py [--prompt 256] [--dtype bfloat16] [--pool-gib 1]
"""

from __future__ import annotations

import argparse

import torch

from ferrox_batch.admission.block_budget import blocks_for
from ferrox_batch.admission.window import DEFAULT_SWA_EVICTION_INTERVAL, WindowPolicy
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore, model_groups

GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
    "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
}
TINY_GEMMA3 = {**GEMMA3_270M, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "sliding_window": 6, "query_pre_attn_scalar": 20,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
LENGTHS = (1024, 4096, 8192, 32768)


def rows(name: str, raw: dict, block: int, prompt: int, dtype: torch.dtype, pool: int) -> None:
    config = ModelConfig.from_dict(raw)
    groups = model_groups(config)
    per_layer = PagedKvStore.bytes_per_block(config, block, dtype) // groups.size  # one layer, one block
    per_block = PagedKvStore.bytes_per_block(config, block, dtype)
    pricing = groups.pricing(WindowPolicy(config.sliding_window, block, DEFAULT_SWA_EVICTION_INTERVAL))
    print(f"\n{name}: {config.num_layers} layers ({groups.local_groups * groups.size} local slots, "
          f"{groups.global_groups * groups.size} global), window {config.sliding_window}, block {block}, "
          f"{groups.global_groups} global + {groups.local_groups} local groups of {groups.size}, {dtype}, "
          f"prompt {prompt}, pool {pool / 2**30:g} GiB")
    print(f"{'positions':>10} {'every layer B/row':>18} {'rows':>8} {'hybrid B/row':>14} {'rows':>8} {'x':>6}")
    for length in LENGTHS:
        if length > config.max_position_embeddings:
            continue
        every = config.num_layers * blocks_for(length, block) * per_layer
        hold = pricing.hold(min(prompt, length - 1), length, block)
        hybrid = hold.blocks * per_block
        old_rows, new_rows = pool // every, (pool // per_block) // hold.blocks
        gain = new_rows / old_rows if old_rows else float("inf")
        print(f"{length:>10} {every:>18,} {old_rows:>8,} {hybrid:>14,} {new_rows:>8,} {gain:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of each row (the rest is max_tokens)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--pool-gib", type=float, default=1.0)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    pool = int(args.pool_gib * 2**30)
    rows("Gemma 3 270M", GEMMA3_270M, 16, args.prompt, dtype, pool)
    rows("tiny Gemma 3 (tests)", TINY_GEMMA3, 16, args.prompt, dtype, pool)


if __name__ == "__main__":
    main()
