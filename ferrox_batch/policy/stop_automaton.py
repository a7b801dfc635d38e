"""`StopAutomaton`: every stop string of a request matched in one pass over the decoded text.

A decode row feeds each new piece to its stop matcher, so the matcher's cost
per token is paid by every row of every step; it must not grow with the
number of stop strings. This is an Aho-Corasick automaton over code points,
built once per request: a trie of the stops with failure links, where a
state stands for the longest suffix of the text so far that is a prefix of
some stop. Feeding a character is one transition plus, amortized, at most
one failure step, whatever the stop list.

Two facts make the state enough for the matcher's whole contract:

* The state's depth is the *withholding* rule: the longest suffix of the
  text that could still grow into a stop. While no stop has completed it is
  a proper prefix of some stop (a whole one would be a match).
* It also bounds where a future match can *start*: any stop that completes
  later began inside that suffix. So once a match is found, scanning on
  until the state's start passes the match's start finds every match that
  starts earlier, or at the same place and is longer -- the matcher's
  "leftmost start wins, ties go to the longest" rule, decided by end
  positions.

Build cost and memory are one trie node per distinct stop prefix: at most the
total length of the stops, which the request limits bound.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["ROOT", "StopAutomaton"]

#: The state before any text (and after a match or a flush): the empty suffix.
ROOT = 0


class StopAutomaton:
    """Aho-Corasick over the given non-empty stop strings. Immutable after
    construction; the caller holds the state (an int) between feeds, so one
    automaton could serve any number of streams."""

    __slots__ = ("_goto", "_fail", "_depth", "_longest")

    def __init__(self, stops: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        longest: list[str | None] = [None]  # the stop ending exactly here, if any
        for stop in stops:
            node = ROOT
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    longest.append(None)
                node = nxt
            if stop:
                longest[node] = stop
        # The root's children fall back to the root; every deeper node to the
        # longest proper suffix of its string that is also in the trie, found
        # breadth first so that shallower nodes are done before it.
        fail = [ROOT] * len(goto)
        queue = deque(goto[ROOT].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                queue.append(child)
                back = fail[node]
                while back != ROOT and ch not in goto[back]:
                    back = fail[back]
                fail[child] = goto[back].get(ch, ROOT)
                # The longest stop that is a suffix here: this node's own if it
                # ends one (nothing longer can be a suffix), else its fallback's.
                if longest[child] is None:
                    longest[child] = longest[fail[child]]
        self._goto = goto
        self._fail = fail
        self._depth = depth
        self._longest = longest

    def depth(self, state: int) -> int:
        """Length of the suffix `state` stands for: what must be withheld."""
        return self._depth[state]

    def walk(self, state: int, text: str) -> int:
        """Advance `state` over `text`, ignoring the stops that complete in it: the state stands for the
        longest suffix of everything walked that is a prefix of some stop."""
        goto, fail = self._goto, self._fail
        for ch in text:
            nxt = goto[state].get(ch)
            while nxt is None and state != ROOT:
                state = fail[state]
                nxt = goto[state].get(ch)
            state = ROOT if nxt is None else nxt
        return state

    def feed(self, state: int, text: str, offset: int) -> tuple[int, tuple[int, str] | None]:
        """Advance `state` over `text`; `offset` is the position of `text[0]`
        in the caller's coordinates. Returns the new state and the match, if
        any: `(start, stop)` with the smallest start among the stops that
        complete inside `text`, the longest on a tie. After a match the rest
        of `text` is not consumed and the state is meaningless (the caller
        starts again from `ROOT`)."""
        goto, fail, depth, longest = self._goto, self._fail, self._depth, self._longest
        best_at = -1
        best: str | None = None
        pos = offset
        for ch in text:
            nxt = goto[state].get(ch)
            while nxt is None and state != ROOT:
                state = fail[state]
                nxt = goto[state].get(ch)
            state = ROOT if nxt is None else nxt
            pos += 1
            if best is not None and pos - depth[state] > best_at:
                # Every stop still under way started after the match we hold:
                # nothing can beat it any more.
                break
            stop = longest[state]
            if stop is not None:
                at = pos - len(stop)
                # A later end at the same start is a longer stop; an earlier
                # start is simply further left. Either wins.
                if best is None or at <= best_at:
                    best_at, best = at, stop
        return state, (None if best is None else (best_at, best))
