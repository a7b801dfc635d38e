"""`MoeShape`: a mixture-of-experts model's shape, as its config gives it, and the reading of it.

The mixture-of-experts families name the same few facts with their own keys (`num_experts` or
`num_local_experts`, `moe_intermediate_size` or `intermediate_size`, ...) and say which layers are sparse
their own ways (`mlp_only_layers` with `decoder_sparse_step`, or the first k dense). Each family's
module reads them into this one value (`ModelConfig.moe`), which its layer specs read; `read_moe` reads the
common keys, each family naming its own. Every bad value is a `ModelLoadError` naming the config field.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferrox_batch.runtime.families.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class MoeShape:
    """What a mixture-of-experts layer's spec reads of the config."""

    experts: int
    top_k: int
    #: Each expert's gated MLP width.
    intermediate: int
    #: Divide the chosen experts' weights by their sum.
    renormalize: bool
    #: Per layer, whether its feed-forward block is the mixture (the others are the dense MLP).
    sparse_layers: tuple[bool, ...]
    #: The shared expert's width, where every row also goes through one.
    shared_intermediate: int | None = None

    def __post_init__(self) -> None:
        if self.experts <= 0:
            raise ModelLoadError(f"config field num_experts must be a positive integer, got {self.experts}")
        if not 0 < self.top_k <= self.experts:
            raise ModelLoadError(f"config field num_experts_per_tok is {self.top_k}: it must be between 1 and the "
                                 f"{self.experts} experts")
        if self.intermediate <= 0:
            raise ModelLoadError(f"config field moe_intermediate_size must be positive, got {self.intermediate}")
        if self.shared_intermediate is not None and self.shared_intermediate <= 0:
            raise ModelLoadError(f"the shared expert's intermediate size must be positive, got "
                                 f"{self.shared_intermediate}")

    def sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]


def positive_int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """`raw[key]` as a positive integer (a whole float is accepted, as JSON writers emit them)."""
    value = raw.get(key, default)
    if value is None:
        raise ModelLoadError(f"config.json is missing the field {key!r}")
    # `is_integer` before `int`: a NaN or an infinity is refused here, by name, rather than by `int`'s error.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()) or value <= 0:
        raise ModelLoadError(f"config field {key} must be a positive integer, got {value!r}")
    return int(value)


def sparse_step_layers(raw: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Qwen's rule: layer i is sparse unless it is in `mlp_only_layers`, where (i + 1) is a multiple of
    `decoder_sparse_step`."""
    step = positive_int(raw, "decoder_sparse_step", 1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, Sequence) or isinstance(dense, str) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ModelLoadError(f"config field mlp_only_layers must be a list of layer indices, got {dense!r}")
    if any(not 0 <= i < layers for i in dense):
        raise ModelLoadError(f"config field mlp_only_layers names layers outside the model's {layers}: {dense!r}")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def read_moe(raw: Mapping[str, Any], *, experts_key: tuple[str, ...], intermediate_key: str, renormalize: bool | None = None,
             sparse_layers: tuple[bool, ...] | None = None, shared_key: str | None = None) -> MoeShape:
    """The shape the config gives: the expert count under the first of the family's `experts_key` the config
    has, the experts' width under its `intermediate_key`, `num_experts_per_tok`,
    `norm_topk_prob` (unless the family always renormalises or never does: `renormalize`), every layer
    sparse unless `sparse_layers` says otherwise, and the shared expert's width under `shared_key` (absent
    or 0: none)."""
    layers = positive_int(raw, "num_hidden_layers")
    # These families route by softmax scores; a config naming another router is one they do not describe.
    for key, theirs in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        if raw.get(key, theirs) != theirs:
            raise ModelLoadError(f"config field {key} is {raw[key]!r}: this family's router is {theirs!r}")
    shared = raw.get(shared_key) if shared_key is not None else None
    norm = raw.get("norm_topk_prob", False) if renormalize is None else renormalize
    if not isinstance(norm, bool):
        raise ModelLoadError(f"config field norm_topk_prob must be true or false, got {norm!r}")
    key = next((k for k in experts_key if k in raw), experts_key[0])
    experts, top_k = positive_int(raw, key), positive_int(raw, "num_experts_per_tok")
    if top_k > experts:
        raise ModelLoadError(f"config field num_experts_per_tok is {top_k}, more than the {experts} experts "
                             f"({key})")
    return MoeShape(
        experts=experts,
        top_k=top_k,
        intermediate=positive_int(raw, intermediate_key),
        renormalize=norm,
        sparse_layers=sparse_layers if sparse_layers is not None else (True,) * layers,
        shared_intermediate=positive_int(raw, shared_key) if shared_key is not None and shared else None,
    )
