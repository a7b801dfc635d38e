"""How one pool of uniform blocks holds KV groups whose layers differ in head shape.

A model's layers may differ in how many KV heads they have and how wide each is (Gemma 4's global layers:
fewer, wider heads than its local ones). The store keeps one allocator and one pool of uniform blocks for
every group, so the ledger still counts blocks alone: each layer slot of a block is as wide as the lcm of
the groups' `block_size` positions (`block_width`: the widest group's, where the widths divide one
another), and each group views the pool with its own head shape, block `b` being its own blocks
`b * scale ...` of which it uses the first (`PagedKvStore.block_scale`). A model whose layers are of one
shape has a scale of one everywhere: exactly the layout of a store without head shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ferrox_batch.admission.kv_groups import KvGroups
from ferrox_batch.runtime.config import ModelConfig


def group_head_shapes(config: ModelConfig, groups: KvGroups) -> tuple[tuple[int, int], ...]:
    """Each group's `(kv_heads, head_dim)`: one per group, its layers' (they are of one kind, so of one shape)."""
    layers = config.kv_layers
    shapes = []
    for members in groups.layers:
        own = {(config.layer_kv_heads(layers[i]), config.layer_head_dim(layers[i])) for i in members}
        if len(own) != 1:
            raise ValueError(f"a KV group's layers differ in head shape: {sorted(own)}")
        shapes.append(own.pop())
    return tuple(shapes)


def block_width(shapes: Sequence[tuple[int, int]], block_size: int) -> int:
    """Elements one layer slot of a block takes: room for the widest group's `block_size` positions, and a
    whole number of positions of every group's (so each group's view of a block starts on one of its slots)."""
    return math.lcm(*(block_size * 2 * heads * dim for heads, dim in shapes))


def position_width(config: ModelConfig) -> int:
    """Elements a block's layer slot holds per position: every KV-writing layer's K and V, padded to the lcm."""
    layers = config.kv_layers
    return math.lcm(*(2 * config.layer_kv_heads(layer) * config.layer_head_dim(layer) for layer in layers))


def pool_views(config: ModelConfig, groups: KvGroups, num_blocks: int, block_size: int, device: torch.device,
               dtype: torch.dtype) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
    """One uninitialised storage of `num_blocks` blocks, and per group its scale (its own blocks per block)
    and its view `[group_size, num_blocks * scale * block_size, 2, kv_heads, head_dim]` of the storage."""
    shapes = group_head_shapes(config, groups)
    width = block_width(shapes, block_size)
    storage = torch.empty((groups.size, num_blocks * width), device=device, dtype=dtype)
    scales = tuple(width // (block_size * 2 * heads * dim) for heads, dim in shapes)
    return scales, tuple(storage.view(groups.size, num_blocks * scale * block_size, 2, heads, dim)
                         for scale, (heads, dim) in zip(scales, shapes))
