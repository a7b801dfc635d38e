"""`PromptLogprobs`: a prompt's log-probabilities, held as flat arrays until an answer writes them.

A request that scores its prompt (`GenerationParams.prompt_logprobs`) gets an entry per prompt token, each
with up to 20 alternatives. As Python objects (a `TokenLogprob`, its tuple of pairs, their ints and
floats) that was about 2.5 KB per token, held from the chunk that computed it until the answer was
written: a 64-row request over 8k-token prompts held about 1.3 GB. Here each entry is its numbers in
`array`s: the token, its log-probability and its rank, and `top` (id, log-probability) pairs, 12 + 8 * top
bytes (172 with 20 alternatives). An entry becomes a `TokenLogprob` only when it is read, so a writer that
walks the entries a slice at a time (`server.logprob_shapes`) never holds more than a slice of objects.

The log-probabilities are float32 (the sampler computes them in float32), so an entry reads back exactly
the value that was stored. It is a `Sequence[TokenLogprob | None]`: the first `leading` entries are None
(nothing predicts a prompt's first token), and it compares equal to any sequence of the same entries.
Shared vocabulary: the runtime fills it from its tensors' buffers, the scheduler appends a chunk's to a
request's, the server reads it. No torch here.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar, overload

from ferrox_batch.logprobs import TokenLogprob

T = TypeVar("T")

#: The arrays' element types: 32-bit ids and ranks (a vocabulary is far below 2**31), float32 values.
ID_CODE = "i"
VALUE_CODE = "f"
if array(ID_CODE).itemsize != 4 or array(VALUE_CODE).itemsize != 4:  # every platform torch runs on
    raise ImportError("PromptLogprobs needs 4-byte C ints and floats")


class PromptLogprobs(Sequence[TokenLogprob | None]):
    """Entries of `top` alternatives each, after `leading` Nones (module docstring)."""

    __slots__ = ("top", "leading", "_tokens", "_logprobs", "_ranks", "_top_ids", "_top_logprobs")
    __hash__ = None  # type: ignore[assignment]  # mutable (`extend`) and equal to plain sequences

    def __init__(self, top: int, leading: int = 0) -> None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError(f"top must be an integer >= 0, got {top!r}")
        self.top = top
        self.leading = leading
        self._tokens = array(ID_CODE)
        self._logprobs = array(VALUE_CODE)
        self._ranks = array(ID_CODE)
        self._top_ids = array(ID_CODE)
        self._top_logprobs = array(VALUE_CODE)

    @classmethod
    def from_buffers(cls, top: int, tokens: Sequence[int], logprobs: bytes, ranks: bytes, top_ids: bytes,
                     top_logprobs: bytes) -> PromptLogprobs:
        """Entries from native-order bytes (a host tensor's, say): `logprobs` float32 and
        `ranks` int32 per token, `top_ids` int32 and `top_logprobs` float32 `top` per token, row by row."""
        out = cls(top)
        out._tokens.extend(tokens)
        for field, buffer in ((out._logprobs, logprobs), (out._ranks, ranks), (out._top_ids, top_ids),
                              (out._top_logprobs, top_logprobs)):
            field.frombytes(buffer)
        n = len(out._tokens)
        if len(out._logprobs) != n or len(out._ranks) != n or len(out._top_ids) != n * top \
                or len(out._top_logprobs) != n * top:
            raise ValueError(f"buffers of {len(out._logprobs)} log-probabilities, {len(out._ranks)} ranks and "
                             f"{len(out._top_ids)} alternatives do not match {n} tokens x {top} alternatives")
        return out

    @property
    def nbytes(self) -> int:
        """Bytes its numbers take (the arrays' contents)."""
        return sum(a.itemsize * len(a) for a in (self._tokens, self._logprobs, self._ranks, self._top_ids,
                                                 self._top_logprobs))

    def extend(self, entries: Iterable[TokenLogprob | None]) -> None:
        """Append `entries`: another `PromptLogprobs` of as many alternatives (copied as arrays), or
        `TokenLogprob`s (their first `top` alternatives; fewer is a ValueError). A None is only taken
        before any entry."""
        if isinstance(entries, PromptLogprobs) and entries.top == self.top and not entries.leading:
            self._tokens.extend(entries._tokens)
            self._logprobs.extend(entries._logprobs)
            self._ranks.extend(entries._ranks)
            self._top_ids.extend(entries._top_ids)
            self._top_logprobs.extend(entries._top_logprobs)
            return
        for entry in entries:
            if entry is None:
                if self._tokens:
                    raise ValueError("a None entry may only come before every other")
                self.leading += 1
                continue
            if len(entry.top) < self.top:
                raise ValueError(f"an entry with {len(entry.top)} alternatives, fewer than {self.top}")
            self._tokens.append(entry.token)
            self._logprobs.append(entry.logprob)
            self._ranks.append(0 if entry.rank is None else entry.rank)
            for token, logprob in entry.top[:self.top]:
                self._top_ids.append(token)
                self._top_logprobs.append(logprob)

    def __len__(self) -> int:
        return self.leading + len(self._tokens)

    def _entry(self, i: int) -> TokenLogprob | None:
        if i < self.leading:
            return None
        i -= self.leading
        k = self.top
        at = i * k
        top = tuple(zip(self._top_ids[at:at + k], self._top_logprobs[at:at + k]))
        return TokenLogprob(self._tokens[i], self._logprobs[i], top, self._ranks[i] or None)  # 0: not computed

    @overload
    def __getitem__(self, index: int) -> TokenLogprob | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[TokenLogprob | None]: ...

    def __getitem__(self, index: int | slice) -> TokenLogprob | None | list[TokenLogprob | None]:
        """An entry made on demand; a slice is a list of the entries it names (only those are made)."""
        return entry_at(index, len(self), self._entry)

    def __iter__(self) -> Iterator[TokenLogprob | None]:
        return (self._entry(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"PromptLogprobs({len(self)} entries, top={self.top}, {self.nbytes} bytes)"


def entry_at(index: int | slice, length: int, entry: Callable[[int], T]) -> T | list[T]:
    """A lazy sequence's `__getitem__` over `entry(i)` for 0 <= i < `length`: a slice makes only the
    entries it names, a negative index counts from the end, one past either end is an `IndexError`."""
    if isinstance(index, slice):
        return [entry(i) for i in range(*index.indices(length))]
    if not -length <= index < length:
        raise IndexError(f"entry {index} of {length}")
    return entry(index % length)
