"""The Qwen3 layer (dense): the Llama layer with an RMSNorm on each head's queries and keys before RoPE.

Qwen3 normalises every query head and every key head over its `head_dim` with weights of its own
(`self_attn.q_norm`, `self_attn.k_norm`, shared by the heads), after the projections and before the
rotation; its `head_dim` is a field of its own, not `hidden_size / heads`, and its projections have no
bias. Everything else is the Llama layer (`llama`).
"""

from __future__ import annotations

import dataclasses

from ferrox_batch.runtime.architectures import llama
from ferrox_batch.runtime.architectures.layer_weights import LayerWeights
from ferrox_batch.runtime.config import ModelConfig


def layer(take: llama.Take, c: ModelConfig, i: int, linear: llama.MakeLinear,
          gate_up: llama.MakeGateUp) -> LayerWeights:
    """Layer `i` of a Qwen3 checkpoint."""
    p = f"model.layers.{i}."
    base = llama.layer(take, c, i, linear, gate_up)
    return dataclasses.replace(base, q_norm=take(p + "self_attn.q_norm.weight", (c.head_dim,)),
                               k_norm=take(p + "self_attn.k_norm.weight", (c.head_dim,)))
