"""Which replica most likely holds a prompt's prefix in its KV cache: the prefix-affinity router's index.

Each replica's prefix cache holds the prompts it served recently. Asking every replica per request would
cost a round trip, so the router keeps its own approximate view: every prompt it routed, cut into fixed-size
chunks, each chunk named by a chained hash (chunk i's hash covers chunks 0..i, as the KV cache's block
hashes do), mapped to the replicas it sent that prefix to. Matching a new prompt walks its chain while some
replica holds the next link, so the replica holding the longest chain holds the longest shared prefix, to
within one chunk. Only whole chunks count: a replica caches whole KV blocks, never a partial one.

Prompts are read from the request's JSON as the server would, under the same nesting bound
(`bounded_json`): a completion's `prompt` (text or token ids; of a batch, the first) and a chat's `messages`
(each role and text in order, so a conversation's next turn extends its previous one); Ollama's `/api/chat`
messages and `/api/generate` prompt likewise (a templated prompt as the chat of its `system` and `prompt`, a
raw one as a completion's), so a conversation finds its replica through either API. A body it cannot
read is no prompt, never an error: the router must place every request, and the replica refuses it. Text is chunked in characters and ids in ids, each about one KV block.

Each chain is in a namespace, the request's tenant (`relay.RelayedRequest.tenant`): a replica's cache keeps
tenants apart (`server.api_keys`), and so does the index, else where a request was routed (and the replica
header on its answer) would tell one tenant what another sent.

What it promises: pure Python over ints and strings (no Ray, no tokenizer, no model); memory bounded by
`capacity` chunk links, the least recently used forgotten first; a replica that leaves is forgotten at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from ferrox_batch import bounded_json

R = TypeVar("R", bound=Hashable)

#: Characters per chunk of a text prompt, and ids per chunk of a token-id prompt: both about one KV block
#: of 16 positions (English text is about 4 characters a token).
TEXT_CHUNK = 64
IDS_CHUNK = 16
#: Chunk links remembered, across all replicas: 65,536 links of 64 characters is about 4 M characters of
#: prompt, more than two replicas' default KV caches hold.
DEFAULT_CAPACITY = 65_536
#: What one request already in flight on a replica costs a new one there, in prompt tokens it would
#: otherwise prefill: a placement saves prefill where a replica holds the prefix, and pays in sharing a
#: busier batch. With a shared system prompt first seen by one replica, this also lets the others take new
#: conversations once that one holds a few (at a pure longest-match rule they would all pile onto it).
DEFAULT_LOAD_COST_TOKENS = 64

Units = str | tuple[int, ...]


def prompt_units(path: str, body: bytes) -> Units | None:
    """The prompt a request to `path` carries, as text or token ids; None for other routes or bodies."""
    if not path.endswith(("/v1/completions", "/v1/chat/completions", "/api/chat", "/api/generate")):
        return None
    try:
        request = bounded_json.loads(body)
    except ValueError:  # malformed, or nested past the bound (JsonTooDeep): the replica answers it with a 400
        return None
    if not isinstance(request, dict):
        return None
    if path.endswith(("/v1/chat/completions", "/api/chat")):
        return _chat_text(request.get("messages"))
    if path.endswith("/api/generate") and request.get("raw") is not True:  # the chat it is rendered as
        prompt, system = request.get("prompt"), request.get("system")
        if not isinstance(prompt, str) or not prompt:
            return None
        said = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
        return _chat_text([*said, {"role": "user", "content": prompt}])
    return _completion_prompt(request.get("prompt"))


def _completion_prompt(prompt: object) -> Units | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return tuple(prompt)
        return _completion_prompt(prompt[0])  # a batch: its first prompt stands for it
    return None


def _chat_text(messages: object) -> str | None:
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):  # content parts: their text, in order
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and
                              isinstance(p.get("text"), str))
        # Separators that text cannot contain keep "ab"+"c" apart from "a"+"bc".
        parts.append(f"{message.get('role')}\x1f{content if isinstance(content, str) else ''}\x1e")
    return "".join(parts)


def chunk_size(units: Units) -> int:
    return TEXT_CHUNK if isinstance(units, str) else IDS_CHUNK


def chain(units: Units, namespace: str | None = None) -> list[int]:
    """The chained hash of each whole chunk of `units` in `namespace` (a tenant's), in order."""
    size = chunk_size(units)
    links: list[int] = []
    previous = hash((type(units).__name__, namespace))  # text and ids, and two tenants, never share a chain
    for start in range(0, len(units) - size + 1, size):
        previous = hash((previous, units[start:start + size]))
        links.append(previous)
    return links


class PrefixIndex:
    """Chunk links -> the replicas they were routed to, least recently used first; not thread-safe (the
    router calls it from its one event loop)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._links: OrderedDict[int, set[Hashable]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._links)

    def match(self, units: Units, namespace: str | None = None) -> dict[Hashable, int]:
        """For each replica holding at least the first chunk, the units of `units` it holds from the start,
        counting only what it was sent in the same `namespace`."""
        size = chunk_size(units)
        matched: dict[Hashable, int] = {}
        holders: set[Hashable] | None = None
        for i, link in enumerate(chain(units, namespace)):
            found = self._links.get(link)
            if not found:
                break
            holders = set(found) if holders is None else holders & found
            if not holders:
                break
            self._links.move_to_end(link)
            for replica in holders:
                matched[replica] = (i + 1) * size
        return matched

    def record(self, units: Units, replica: Hashable, namespace: str | None = None) -> None:
        """`units` was sent to `replica` in `namespace`: it will hold their whole chunks there."""
        for link in chain(units, namespace):
            self._links.setdefault(link, set()).add(replica)
            self._links.move_to_end(link)
        while len(self._links) > self.capacity:
            self._links.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """`replica` left: nothing routes to it for its cache any more."""
        for link in [link for link, holders in self._links.items() if replica in holders]:
            holders = self._links[link]
            holders.discard(replica)
            if not holders:
                del self._links[link]

    def replicas(self) -> set[Hashable]:
        return set().union(*self._links.values()) if self._links else set()


def load_cost_units(units: Units, load_cost_tokens: int = DEFAULT_LOAD_COST_TOKENS) -> int:
    """`load_cost_tokens` in the units of `units`: text counts characters, about 4 to a token."""
    return load_cost_tokens * (TEXT_CHUNK // IDS_CHUNK if isinstance(units, str) else 1)


def rank(candidates: Sequence[R], matched: Mapping[R, int], loads: Mapping[R, int | None], length: int,
         load_cost: int) -> list[list[R]]:
    """Candidates in ranks, most preferred first, for a prompt of `length` units that each candidate holds
    `matched[c]` units of from the start.

    A candidate's cost is what it would prefill (`length - matched`) plus `load_cost` per request it has in
    flight; the cheapest come first, the others after. Without any match, one rank: the caller picks the
    least loaded by fresh queue lengths. An unknown load (None) counts as zero, as a replica that just
    started has none.
    """
    if not candidates:
        return []
    if max((matched.get(c, 0) for c in candidates), default=0) <= 0:
        return [list(candidates)]
    cost = {c: length - matched.get(c, 0) + load_cost * (loads.get(c) or 0) for c in candidates}
    cheapest = min(cost.values())
    first = [c for c in candidates if cost[c] == cheapest]
    rest = [c for c in candidates if cost[c] != cheapest]
    return [first, rest] if rest else [first]
