"""`KvElem` and `KvShape`: what one token position of KV cache costs, in bytes.

The admission ledger counts positions; operators and error bodies speak bytes.
`KvShape` converts between the two so a refusal can say how much memory a
request would have needed. It prices every layer at every position (sliding
windows deliberately ignored, as upstream), and its arithmetic saturates at
`2**64 - 1` like Rust's `saturating_mul`: a reporting number never raises and
never wraps, whatever the request asked for.

Pure Python: the paged store that actually holds the tensors lives elsewhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from ferrox_batch.checks import UNLIMITED, check_int


def _saturate(value: int) -> int:
    return value if value < UNLIMITED else UNLIMITED


class KvElem(enum.Enum):
    """Storage format of one KV element: the store holds fp32, or a 16-bit type (fp16 or bf16)."""

    F32 = "f32"
    F16 = "f16"

    def bytes_for(self, elems: int) -> int:
        """Bytes to store `elems` elements; saturating."""
        check_int("elems", elems)
        return _saturate(elems * (4 if self is KvElem.F32 else 2))


class _HasKvGeometry(Protocol):
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class KvShape:
    """KV geometry of a model: layers x (K and V elements per token per layer) x element format."""

    n_layers: int
    elems_per_token_per_layer: int
    elem: KvElem

    def __post_init__(self) -> None:
        check_int("n_layers", self.n_layers, minimum=1)
        check_int("elems_per_token_per_layer", self.elems_per_token_per_layer, minimum=1)
        if not isinstance(self.elem, KvElem):
            raise TypeError(f"elem must be a KvElem, got {self.elem!r}")

    @classmethod
    def from_config(cls, cfg: _HasKvGeometry, elem: KvElem) -> KvShape:
        """GQA layout: K and V each `num_kv_heads * head_dim` wide, on every layer."""
        layers = check_int("num_layers", getattr(cfg, "num_layers", None), minimum=1)
        heads = check_int("num_kv_heads", getattr(cfg, "num_kv_heads", None), minimum=1)
        head_dim = check_int("head_dim", getattr(cfg, "head_dim", None), minimum=1)
        return cls(layers, 2 * heads * head_dim, elem)

    def per_token_kv_bytes(self) -> int:
        """Bytes one position costs across every layer (a method, as upstream)."""
        return _saturate(self.n_layers * self.elem.bytes_for(self.elems_per_token_per_layer))

    def kv_bytes_for_tokens(self, tokens: int) -> int:
        """Bytes for `tokens` positions on every layer; saturating."""
        check_int("tokens", tokens)
        elems = _saturate(self.elems_per_token_per_layer * tokens)
        return _saturate(self.n_layers * self.elem.bytes_for(elems))
