"""`StopTokens`: the model's end-of-generation token ids (docs/upstream.md, Stopping and text).

Built from the checkpoint (generation_config / config / tokenizer EOS) by the
tokenizer loader and handed to the batcher with every request; the batcher
checks sampled ids against it unless the request sets `ignore_eos`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass(frozen=True, slots=True)
class StopTokens:
    ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        for i in self.ids:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise ValueError(f"stop token ids must be non-negative integers, got {i!r}")

    @classmethod
    def default(cls) -> "StopTokens":
        return cls(frozenset())

    @classmethod
    def from_eos(cls, eos: int | None) -> "StopTokens":
        return cls(frozenset() if eos is None else frozenset((eos,)))

    @classmethod
    def of(cls, ids: Iterable[int]) -> "StopTokens":
        return cls(frozenset(ids))

    def contains(self, token: int) -> bool:
        return token in self.ids

    def __contains__(self, token: object) -> bool:
        return token in self.ids

    def __len__(self) -> int:
        return len(self.ids)
