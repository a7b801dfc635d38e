"""The same forward's inputs seen through another sliding window: for models whose layers differ.

`build_inputs` derives each attention group's key range (the decode rows' first key, the prefill chunks'
masks) from one window. A model whose layers all slide by the same window, or none does, needs only
that. Gemma 3 attends locally on five layers in six and globally on the sixth: the forward builds its
inputs once for the global layers and takes this view of them for the local ones. Only the key ranges
change; tokens, positions, slots and tables are shared, so the view costs a few small tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from ferrox_batch.runtime.kv.batch_inputs import BatchInputs, DecodeGroup, PrefillChunk


def windowed(inputs: BatchInputs, window: int) -> BatchInputs:
    """`inputs` with every query attending only to its last `window` positions (itself included)."""
    decode = inputs.decode
    if decode is not None:
        lo = torch.maximum(decode.lo, decode.hi - window)
        mask = None
        if decode.ctx_slots is not None:  # the gather path: `[N, 1, 1, L]` over the gathered keys
            width = decode.ctx_slots.numel() // decode.count
            keys = torch.arange(width, device=lo.device)
            mask = ((keys[None, :] < decode.hi[:, None]) & (keys[None, :] >= lo[:, None]))[:, None, None, :]
        decode = DecodeGroup(decode.count, decode.tables, lo, decode.hi, decode.ctx_slots, mask)
    prefill = [_windowed_chunk(chunk, window) for chunk in inputs.prefill]
    return dataclasses.replace(inputs, decode=decode, prefill=prefill)


def _windowed_chunk(chunk: PrefillChunk, window: int) -> PrefillChunk:
    width = chunk.ctx_slots.numel()
    if width <= window:  # every key is inside every query's window: the causal mask is already exact
        return chunk
    keys = torch.arange(width, device=chunk.ctx_slots.device)
    qpos = keys[width - chunk.length:]
    mask = (keys[None, :] <= qpos[:, None]) & (keys[None, :] > qpos[:, None] - window)
    if chunk.mask is not None:
        mask &= chunk.mask
    return PrefillChunk(chunk.ctx_slots, chunk.length, mask)
