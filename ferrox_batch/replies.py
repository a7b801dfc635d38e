"""A request's replies, as every reader of them sees them: zero or more `Chunk`s of text, then one `Finished`.

The worker hands each request's replies to the request's sink (`scheduler.sink`); the blocking handle's
`Ticket` reads them on the caller's thread, and the HTTP server's bridge reads them on its event loop
(`server.streaming`). One vocabulary for all of them, so a reply means the same thing wherever it is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.logprobs import TokenLogprob


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of visible text, streamed before the request's `Finished`, with the log-probabilities and the
    ids of the tokens generated since the last chunk (when the request asked for them)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    """The request's one and only final reply: its result, or the error that ended it (a `DecodeError`
    from the batcher; a reader may end a request with an error of its own, which any exception can be).
    `finished_at`: when the reader received it (monotonic seconds), where the reader times requests."""

    result: GenerationResult | BaseException
    finished_at: float | None = None

    @property
    def error(self) -> BaseException | None:
        """The error that ended the request; None when it has a result."""
        return None if isinstance(self.result, GenerationResult) else self.result


#: What a request's replies are: zero or more `Chunk`s, then exactly one `Finished`.
Reply = Union[Chunk, Finished]

#: The upstream's name for a reply event, exported under it from the package's top (`docs/upstream.md`).
BatcherEvent = Reply
