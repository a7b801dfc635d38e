"""How llama.cpp writes the mixture-of-experts families as GGUF, and what it reads of their experts.

llama.cpp's converter stacks each layer's experts into one 3-D tensor per projection (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`: `[experts, rows, cols]` in HF order) beside the router (`ffn_gate_inp`), so
the reader gives them under the STACKED layout's names (`moe_layers.STACKED`), which every MoE family's
builder takes. Qwen2-MoE's shared expert is `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp`
(the converter writes HF's `[1, hidden]`; llama.cpp reads it as `{hidden}`, which a 1-D tensor also is).

Of the metadata, llama.cpp reads `expert_count` and `expert_used_count` for every one of these
architectures, `expert_feed_forward_length` where the experts have a width of their own (its fallback when
absent: the dense width over the experts used), and `expert_shared_feed_forward_length` (its fallback: the
dense width). Everything else it hardcodes per architecture, and so does `expert_fields`: softmax scores,
every layer sparse (its qwen2moe / qwen3moe graphs have no dense layer: a checkpoint with
`mlp_only_layers` or a `decoder_sparse_step` above one cannot be converted), and whether the k chosen
weights are divided by their sum, which transformers reads from `norm_topk_prob`: always for qwen3moe,
granitemoe and llama (Mixtral), never for qwen2moe and olmoe. Those are what the published checkpoints set
(Qwen3-MoE `true`, Qwen1.5-MoE / Qwen2-57B and OLMoE `false`, and Mixtral and Granite MoE always
renormalise), so the two agree on them; for a checkpoint that sets the other value, transformers and
llama.cpp differ, and the file no longer says which the source set: the reader follows llama.cpp, the only
computation the file still describes.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.families.gguf_metadata import LLAMA_LAYER, Meta

#: The Llama layer's attention and norms (llama.cpp's names) without the dense MLP.
ATTENTION_LAYER: Mapping[str, str] = MappingProxyType(
    {name: hf for name, hf in LLAMA_LAYER.items() if name not in ("ffn_gate", "ffn_up", "ffn_down")})
#: The router and the stacked experts, llama.cpp's name -> the STACKED layout's module name.
EXPERT_TENSORS: Mapping[str, str] = MappingProxyType({
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj"})
#: Qwen2-MoE's shared expert and its sigmoid gate.
SHARED_EXPERT_TENSORS: Mapping[str, str] = MappingProxyType({
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"})


def moe_layer(*parts: Mapping[str, str]) -> Mapping[str, str]:
    """A layer tensor map: `parts` (attention, norms, a shared expert) and the router and the experts."""
    merged: dict[str, str] = {}
    for part in parts:
        merged.update(part)
    return MappingProxyType({**merged, **EXPERT_TENSORS})


def expert_fields(meta: Meta, config: dict[str, Any], *, experts_key: str, renormalize: bool,
                  width_key: str | None = None, shared_key: str | None = None) -> dict[str, Any]:
    """The config fields of the experts as llama.cpp reads them (module docstring): the count under
    `experts_key`, `num_experts_per_tok`, `norm_topk_prob` (`renormalize`: what the architecture's graph
    does), the experts' width under `width_key` where they have their own, the shared expert's under
    `shared_key`. `ModelLoadError` naming the key for a count that is not positive or more experts used
    than there are."""
    experts = meta.integer("expert_count")
    if experts <= 0:
        raise ModelLoadError(f"metadata key {meta.arch}.expert_count is {experts}: a mixture of experts needs "
                             f"at least one")
    used = meta.integer("expert_used_count")
    if not 0 < used <= experts:
        raise ModelLoadError(f"metadata key {meta.arch}.expert_used_count is {used}: it must be between 1 and "
                             f"{meta.arch}.expert_count ({experts})")
    out: dict[str, Any] = {experts_key: experts, "num_experts_per_tok": used, "norm_topk_prob": renormalize}
    dense = config["intermediate_size"]
    if width_key is not None:
        out[width_key] = _positive(meta, "expert_feed_forward_length", dense // used)
    if shared_key is not None:
        out[shared_key] = _positive(meta, "expert_shared_feed_forward_length", dense)
    return out


def _positive(meta: Meta, key: str, fallback: int) -> int:
    """`key`, or llama.cpp's `fallback` where the file has none (or zero, which llama.cpp reads as none)."""
    value = meta.integer(key, 0) or fallback
    if value <= 0:
        raise ModelLoadError(f"metadata key {meta.arch}.{key} is {value}: a width must be positive")
    return value
