"""The server-sent events of one streamed request, from its first event to `data: [DONE]`.

A request's choices (`n`) stream through one body: each choice's opening chunks, then its text as it comes
(with the log-probabilities of the tokens it carries), then its closing and final chunks once it is done;
after the last choice, the usage chunk when asked for, and `[DONE]`. A failure after text went out is
reported in-band, as OpenAI's streams do: the worker's (a choice that failed) and the server's own while
it writes the events alike (`http.streaming.ended_in_band`: the headers are out, so the body is the only place left to
say it), and the stream still ends with `[DONE]`. The response that carries this body cancels the request
if it ends early (`streaming.EventStreamResponse`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.replies import Chunk
from ferrox_batch.server.http.errors import error_body
from ferrox_batch.server.openai.wire_format import DONE, WireFormat, finish_reason, output_ids, sse
from ferrox_batch.server.http.streaming import Event
from ferrox_batch.usage import Usage


def failure_events(error: BaseException) -> list[bytes]:
    """How a stream that has begun tells a failure: OpenAI's error object as an event, then `[DONE]`."""
    return [sse(error_body(error)), DONE]


async def sse_events(first: tuple[int, Event], events: AsyncIterator[tuple[int, Event]], fmt: WireFormat,
                     include_usage: bool, choices: int) -> AsyncIterator[bytes]:
    """The SSE body from the first event on: `events` are the choices' (index, event) pairs as they come."""
    for chunk in fmt.opening_chunks(choices):
        yield sse(chunk)
    sent = [0] * choices  # log-probabilities streamed so far, per choice
    ids_sent = [0] * choices  # token ids streamed so far, per choice (`return_token_ids`)
    usages: dict[int, Usage] = {}
    index, event = first
    while True:
        if isinstance(event, Chunk):
            chunks = fmt.stream_chunks(index, event.text, event.logprobs, event.token_ids)
            for chunk in chunks:
                yield sse(chunk)
            if chunks:  # the first carried the tokens' log-probabilities and ids
                sent[index] += len(event.logprobs)
                ids_sent[index] += len(event.token_ids)
        elif isinstance(event.result, GenerationResult):
            closing, reason = fmt.closing_chunks(index, event.result.finish_reason)
            for chunk in closing:
                yield sse(chunk)
            rest = (event.result.logprobs or ())[sent[index]:]
            ids = output_ids(event.result)[ids_sent[index]:]
            yield sse(fmt.final_chunk(index, reason or finish_reason(event.result.finish_reason), rest, ids))
            usages[index] = event.result.usage
            if len(usages) == choices:
                if include_usage:
                    yield sse(fmt.usage_chunk([usages[i] for i in range(choices)]))
                yield DONE
                return
        else:  # a failure after text went out: reported in-band, as OpenAI streams do
            for piece in failure_events(event.error):
                yield piece
            return
        index, event = await anext(events)
