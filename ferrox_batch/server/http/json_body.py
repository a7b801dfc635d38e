"""JSON answers built and encoded off the event loop, in pieces, and sent under flow control.

Why it exists: a big answer (16 choices of 8,000 tokens with 20 alternatives each is about 180 MB
of JSON) takes seconds to build and one `json.dumps` call of seconds to encode. On the loop that
stops every other exchange; on a thread it still does, because the C encoder holds the GIL for
the whole call. And one `send` of a whole body parks all of it in the transport's buffer, where
a client that never reads keeps it for as long as it keeps the connection.

What it promises:

* `json_pieces(value)` writes exactly `json.dumps(value, ensure_ascii=False, separators=(",", ":"))`
  (what Starlette's `JSONResponse` writes), in pieces: dicts entry by entry, lists a slice at a
  time, so no one call into the C encoder covers more than a slice, and other threads (the
  loop's among them) run between calls. The elements of a list are taken to be small (a slice
  is one call): true of every list of an answer, whose elements are ids, tokens, numbers, or one
  token's log-probabilities with its alternatives (at most `MAX_TOP_LOGPROBS`).
* Parts of a value may be made only when the text reaches them, and dropped once written: an
  iterator is an array of its elements, and `Slices` an array written a list at a time. A big
  answer is then never whole in memory as objects either (millions of small dicts and lists,
  several times the size of their JSON), and the garbage collector, whose full passes hold the
  GIL for as long as they take to walk every live object, has few to walk.
* `JSONBodyResponse` pulls the pieces from a blocking iterator on a thread pool, about
  `PIECE_BYTES` at a time, and sends each as the client takes it (`streaming.PushedResponse`: each
  send within the write timeout, the connection watched), so it holds one piece ahead of the
  client, never the whole body. An answer that fits in one piece goes out as a plain response
  with its `Content-Length`; a bigger one is sent chunked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from starlette.types import Receive, Scope, Send

from ferrox_batch.server.http.streaming import PushedResponse

#: About how many characters of body each pool task encodes, and the most bytes one send carries.
PIECE_BYTES = 64 * 1024
#: Elements of a list encoded per call when they are containers (a logprob entry with 20 alternatives
#: is about 1.3 KB of JSON: 64 of them take a few milliseconds), and when they are not.
SLICE_CONTAINERS = 64
SLICE_SCALARS = 4096

_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


class Slices:
    """A JSON array made a slice at a time: `slices` yields lists whose concatenation is the array."""

    __slots__ = ("slices",)

    def __init__(self, slices: Iterable[list[Any]]) -> None:
        self.slices = slices


def json_pieces(value: Any) -> Iterator[str]:
    """The JSON text of `value`, in pieces whose concatenation is what `JSONResponse` would write.

    Keys must be strings. An iterator (a generator) is an array whose elements are made only as the
    text reaches them, each written piecewise itself: how an answer builds one choice at a time.
    """
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                raise TypeError(f"JSON keys must be strings here, got {key!r}")
            yield ("," if i else "") + _encode(key) + ":"
            yield from json_pieces(item)
        yield "}"
    elif isinstance(value, Slices):
        yield "["
        first = True
        for part in value.slices:
            if part:
                yield ("" if first else ",") + _encode(part)[1:-1]
                first = False
        yield "]"
    elif isinstance(value, Iterator):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from json_pieces(item)
        yield "]"
    elif isinstance(value, (list, tuple)) and value:
        step = SLICE_CONTAINERS if isinstance(value[0], (dict, list, tuple)) else SLICE_SCALARS
        yield "["
        for start in range(0, len(value), step):
            yield ("," if start else "") + _encode(value[start:start + step])[1:-1]
        yield "]"
    else:
        yield _encode(value)


class PieceSource:
    """A blocking iterator of text pieces, taken `PIECE_BYTES` of encoded body at a time (on a pool thread)."""

    def __init__(self, pieces: Iterable[str]) -> None:
        self._pieces = iter(pieces)
        self._done = False

    def take(self) -> tuple[bytes, bool]:
        """The next piece of body and whether more follows."""
        parts: list[str] = []
        size = 0
        while size < PIECE_BYTES:
            part = next(self._pieces, None)
            if part is None:
                self._done = True
                break
            parts.append(part)
            size += len(part)
        return "".join(parts).encode("utf-8"), not self._done


class JSONBodyResponse(PushedResponse):
    """A JSON answer produced by `pieces` (a blocking iterator, run on `pool`), sent as the client takes it."""

    media_type = "application/json"

    def __init__(self, pieces: Iterable[str], pool: concurrent.futures.Executor, *, write_timeout: float,
                 status_code: int = 200) -> None:
        self._source = PieceSource(pieces)
        self._pool = pool
        super().__init__(self._rest(), write_timeout=write_timeout, status_code=status_code)
        self._first: tuple[bytes, bool] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        first, more = self._first = await self._take()
        if not more:  # one piece: a plain body, with its length
            self.headers["content-length"] = str(len(first))
        await super().__call__(scope, receive, send)

    async def _take(self) -> tuple[bytes, bool]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._source.take)

    async def _rest(self) -> AsyncIterator[bytes]:
        assert self._first is not None, "the response is called before its body is read"
        piece, more = self._first
        while True:
            # A piece past the size (one long string) goes out in sends of `PIECE_BYTES`, each under
            # flow control: the transport never holds more than its high water mark and one of them.
            for at in range(0, len(piece), PIECE_BYTES):
                yield piece[at:at + PIECE_BYTES]
            if not more:
                return
            piece, more = await self._take()
