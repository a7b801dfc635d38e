"""`NgramIndex`: a row's draft for speculative decoding, looked up in its own prompt and output.

Much of what a model writes repeats its input (code edits, summaries, extraction, quoted answers). The
draft for a row's next tokens is what followed the most recent earlier occurrence of its last n tokens,
trying the longest n first (`n_max` down to `n_min`), up to `k` tokens; a row whose suffix occurred
nowhere earlier gets no draft and decodes as usual. When the occurrence is so recent that fewer than `k`
tokens follow it, the copy runs on over the tokens it drafts itself (as an overlapping copy does): a
sequence that repeats with period p is predicted to go on repeating, so a loop of one token drafts `k` of
it rather than one. Verifying a draft costs one forward over its positions, so a good draft turns several
steps into one.

Why an index rather than a scan: a scan of the whole sequence per row per step costs its length in Python
on the worker's thread. The index keeps, for each n, the end of the latest occurrence of every n-gram seen
so far; appending a token registers the n-grams that end just before it, so a lookup never finds the
suffix itself. Appending and drafting cost O(n_max) each; memory is one entry per position and n.
Torch-free: the scheduler owns it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class NgramIndex:
    """A growing token sequence and, per n in [n_min, n_max], where each n-gram last ended."""

    __slots__ = ("n_min", "n_max", "_tokens", "_ends")

    def __init__(self, n_min: int, n_max: int, tokens: Iterable[int] = ()) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._tokens: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Add `token`; the n-grams ending just before it become findable (never the current suffix)."""
        tokens = self._tokens
        end = len(tokens)
        for n, ends in self._ends.items():
            if end >= n:
                ends[tuple(tokens[end - n:end])] = end
        tokens.append(token)

    def draft(self, k: int) -> list[int]:
        """`k` tokens copied on from the latest earlier occurrence of the sequence's last n tokens, for the
        longest n in range that occurred; [] when none did (or `k` is 0)."""
        tokens = self._tokens
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            end = self._ends[n].get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return _copy_on(tokens, end, k)
        return []


def _copy_on(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """`k` tokens predicted to follow `tokens` by copying from `start` on: past the end, the copy reads
    what it has drafted (the sequence taken to repeat with period `len(tokens) - start`)."""
    out = list(tokens[start:start + k])
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


def reference_draft(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The same draft by a plain scan (what the index must agree with; for tests and as the definition)."""
    if k <= 0:
        return []
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        suffix = list(tokens[len(tokens) - n:])
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if list(tokens[start:start + n]) == suffix:
                return _copy_on(tokens, start + n, k)
    return []
