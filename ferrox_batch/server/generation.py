"""`Generations`: how one app serves a generation request of any API it speaks (a `Surface`: OpenAI's
completions, chat, Responses and embeddings, Anthropic's messages, ...).

The pipeline of one request, and why each step is where it is:

1. The body is read on the loop (refused with 413 past `max_body_bytes`;
   the rest of it is drained first, so the client reads a clean 413 instead
   of a connection reset). Reading it has a deadline (`body_read_timeout`,
   408 past it): the request already holds one of the open-request slots,
   and uploads that trickle in or never finish must not hold them all.
2. On a small *prepare* pool (`preparation`): JSON parsing, validation,
   tokenizing or templating, and `batcher.submit`, which raises every refusal
   before anything is queued. A 1 MB prompt is tokenized there, never on the loop,
   and without the GIL; one too long to ever fit is refused before it is tokenized
   (`prompt_ids`). A refusal is a JSON error with the error's own status (and
   `Retry-After`).
3. The request is submitted with a `ReplyBridge` as its reply sink: the
   worker posts its text and its final event straight to the loop, so no
   thread waits per request in flight. A request that would make more than
   `max_concurrent_requests` open (in flight, being prepared, or sending its
   body) is refused with 503 `server_busy` before its body is read, so a
   busy server never waits on an upload to say so.
4. Headers go out once the first event arrives, or once the answer format's
   `keepalive_interval` has passed without it, whichever is first: a failure
   the worker reports sooner (a prompt token outside the vocabulary, a KV
   page store that said no) is still a plain JSON error with its status, and a
   stream that waits longer (a long prompt read, a queue) begins with the
   format's opening and sends its keep-alives (SSE comments, Anthropic's
   pings) until the first event, so proxies do not cut a silent connection.
   The stream then carries the answer in the surface's shapes; one that fails
   after its headers went out (on the worker, or while its events are
   written) ends with the format's error events (`streaming.ended_in_band`).
   A whole answer is built and encoded on the *answer* pool and sent a piece
   at a time (`json_body`): a big one never stops the loop, nor sits whole in
   a buffer.
5. A client that disconnects, streaming or not, cancels its request
   (`Ticket.cancel`): the worker frees its KV blocks at its next tick. So does
   one that takes nothing of its reply for `write_timeout` seconds, or falls
   `max_buffered_reply_bytes` behind its stream (`streaming`).

A request counts as in flight from `submit` until the batcher answers it
(cancelled ones included), which is what `vllm:num_requests_running` is
computed from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Iterator

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ferrox_batch.cancel import CancelToken
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.errors import BatcherClosed, DecodeError
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.replies import Finished
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.http.access import cache_namespace, client_identity, request_id
from ferrox_batch.server.http.body import BodyReadTimedOut, read_body
from ferrox_batch.server.choices import best, merged
from ferrox_batch.server.client_policy import ClientPolicy
from ferrox_batch.server.http.error_shapes import ErrorShape
from ferrox_batch.server.http.errors import ServerBusy, error_response, failure_response
from ferrox_batch.server.http.json_body import JSONBodyResponse
from ferrox_batch.server.http.metrics import ServerMetrics
from ferrox_batch.server.openai.embeddings import DEFAULT_POOLING
from ferrox_batch.server.http.generation_limits import Limits
from ferrox_batch.server.preparation import Preparer
from ferrox_batch.server.reasoning import ReasoningParser
from ferrox_batch.server.request_caps import RequestCaps
from ferrox_batch.server.openai.wire_format import finish_reason
from ferrox_batch.server.stream_start import first_within, kept_alive
from ferrox_batch.server.surface import AnsweredAtOnce, AnswerFormat, Prepared, Surface
from ferrox_batch.server.http.streaming import (
    Event,
    EventStreamResponse,
    Final,
    ended_in_band,
    ReplyBridge,
    next_or_disconnect,
    wait_for_disconnect,
)

log = logging.getLogger("ferrox_batch.server")

#: Seconds shutdown waits for cancelled requests to be answered before giving up on them.
SHUTDOWN_JOIN_SECS = 10.0
#: nginx's "client closed request": nobody reads it, but access logs then say what happened.
CLIENT_CLOSED_REQUEST = 499
#: Threads that build and encode whole (non-streamed) answers, apart from the prepare pool so that
#: finished answers never queue behind new requests' tokenizing.
ANSWER_THREADS = 2


class Generations:
    """The generation endpoints of one app: its pools, its in-flight requests, its metrics."""

    def __init__(self, batcher: ContinuousBatcher, tokenizer: Tokenizer, model_names: str | tuple[str, ...],
                 limits: Limits,
                 policy: ClientPolicy = ClientPolicy(), reasoning: ReasoningParser | None = None,
                 pooling: str = DEFAULT_POOLING, caps: RequestCaps = RequestCaps(), *,
                 escape_control_tokens: bool = False, harmony: bool = False) -> None:
        self.batcher = batcher
        #: Whether control-token text in messages' content is read as text (`--escape-control-tokens`).
        self.escape_control_tokens = escape_control_tokens
        self.tokenizer = tokenizer
        names = (model_names,) if isinstance(model_names, str) else model_names
        self.model_name = names[0]
        self.limits = limits
        #: What one request may cost (`request_caps`), `allowed_token_ids`' cap resolved to the vocabulary.
        self.caps = caps.resolved(batcher.vocab_size)
        self.in_flight: set[ReplyBridge] = set()  # touched on the loop thread only
        self._preparing = 0  # requests reading their body or on the prepare pool, not yet in flight (loop thread)
        self._preparer = Preparer(batcher, tokenizer, names[0], limits.default_max_tokens,
                                  limits.default_chat_max_tokens, policy,
                                  max_buffered_reply_bytes=limits.max_buffered_reply_bytes, reasoning=reasoning,
                                  pooling=pooling, aliases=names[1:], caps=self.caps,
                                  escape_control_tokens=escape_control_tokens, harmony=harmony)
        self.metrics = ServerMetrics(batcher.stats, lambda: len(self.in_flight), names[0])
        #: Names of this app's pool threads start with this (unique per app: leaks can be checked).
        self.thread_prefix = f"ferrox-http-{id(self):x}"
        #: Where parsing, tokenizing and submitting run (and the tokenization endpoints' work): never the loop.
        self.prepare_pool = concurrent.futures.ThreadPoolExecutor(limits.prepare_threads,
                                                                  f"{self.thread_prefix}-prepare")
        #: Where whole answers are built and encoded (`json_body`).
        self.answer_pool = concurrent.futures.ThreadPoolExecutor(ANSWER_THREADS, f"{self.thread_prefix}-answer")

    @property
    def preparer(self) -> Preparer:
        """What turns this app's bodies into submitted requests (read by the endpoints that only count)."""
        return self._preparer

    async def serve(self, request: Request, *, surface: Surface) -> Response:
        """Answer one generation request as `surface` reads and writes its API, its refusals and failures in
        that API's error shape."""
        errors = surface.errors
        arrival = time.monotonic()
        rid = request_id(request)
        disconnected: asyncio.Future | None = None
        try:
            # Counted before the body is read: a body that arrives slowly (or never) must not
            # keep a busy server from answering, nor hold a buffer past the limit.
            open_now = len(self.in_flight) + self._preparing
            if open_now >= self.limits.max_concurrent_requests:
                raise ServerBusy(open_now, self.limits.max_concurrent_requests)
            self._preparing += 1
            try:
                raw = await read_body(request, self.limits.max_body_bytes, self.limits.body_read_timeout)
                # Watched from here on: a client that leaves while its request is prepared cancels the work
                # done for it there (a grammar's conversion), not only what follows.
                disconnected = asyncio.ensure_future(wait_for_disconnect(request.receive))
                gone = CancelToken()
                disconnected.add_done_callback(lambda watch: None if watch.cancelled() else gone.cancel())
                prepared = await self._prepare(raw, surface, arrival, rid, cache_namespace(request),
                                               client_identity(request), gone)
            finally:
                self._preparing -= 1
        except DecodeError as refusal:
            if disconnected is not None:
                disconnected.cancel()
            self.metrics.refused(refusal.code)
            log.info("request %s: refused, %s (%s)", rid, refusal.http_status, refusal.code)
            response = error_response(refusal, errors)
            if isinstance(refusal, BodyReadTimedOut):
                # The rest of the body may still be on its way: the connection cannot carry
                # another request, so say it will close (the ASGI server closes it either way).
                response.headers["connection"] = "close"
            return response
        except ClientDisconnect:  # gone while sending the body: nothing was submitted
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except AnsweredAtOnce as answered:  # needs no generation (a load request)
            if disconnected is not None:
                disconnected.cancel()
            return JSONResponse(answered.body)
        except BaseException:
            if disconnected is not None:
                disconnected.cancel()
            raise
        assert disconnected is not None  # set once the body was read
        bridges = prepared.bridges
        for bridge in bridges:
            if bridge.final is None:  # the worker may have answered already (a refusal at admission)
                self.in_flight.add(bridge)
        events = merged(bridges)
        handed_off = False
        try:
            fmt = surface.answer_format(prepared, self._preparer, rid)
            if prepared.request.stream:
                pending = await self._first_within(events, disconnected, bridges, errors, fmt.keepalive_interval)
                if isinstance(pending, Response):
                    return pending
                handed_off = True
                return EventStreamResponse(
                    ended_in_band(kept_alive(fmt, pending, events), fmt.failure_events, rid),
                    write_timeout=self.limits.write_timeout, on_close=lambda: self._abandon(*bridges),
                    cut=[bridge.overflowed for bridge in bridges], media_type=fmt.media_type)
            first = await self._next(events, disconnected, bridges, errors)
            if isinstance(first, Response):
                return first
            # A request that does not stream gets no `Text` events: the next event of each choice is final.
            finals = dict([first])
            while len(finals) < len(bridges):
                got = await self._next(events, disconnected, bridges, errors)
                if isinstance(got, Response):
                    return got
                finals[got[0]] = got[1]
            results = [finals[i].result for i in range(len(bridges))]  # type: ignore[union-attr]
            asked = prepared.request.options.logprobs is not None
            # Built and encoded on the answer pool, a piece at a time, as the client takes it: a big
            # answer never blocks the loop, nor sits whole in a buffer.
            return JSONBodyResponse(_answer(fmt, results, prepared.request.best_of, prepared.request.n, asked),
                                    self.answer_pool, write_timeout=self.limits.write_timeout)
        finally:
            disconnected.cancel()
            if not handed_off:
                await events.aclose()
                for bridge in bridges:
                    bridge.abandon()  # a no-op once answered; cancels if this handler itself was cancelled

    async def _first_within(self, events: AsyncIterator[tuple[int, Event]], disconnected: asyncio.Future,
                            bridges: list[ReplyBridge], errors: ErrorShape,
                            interval: float | None) -> asyncio.Future | Response:
        """A stream's first (choice, event) as a future (`stream_start.first_within`); or the response that
        ends the exchange before any stream: 499 if the client left (its requests are cancelled), the error's
        status if a choice failed within the wait."""
        first = await first_within(events, disconnected, interval)
        if first.cancelled():
            self._abandon(*bridges)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if first.done() and first.exception() is None:
            _, event = first.result()
            if isinstance(event, Finished) and event.error is not None:
                return failure_response(event.error, errors)
        return first

    async def _next(self, events: AsyncIterator[tuple[int, Event]], disconnected: asyncio.Future,
                    bridges: list[ReplyBridge], errors: ErrorShape) -> tuple[int, Event] | Response:
        """The next (choice, event); or the response that ends the exchange: 499 if the client left (its
        requests are cancelled), the error if a choice failed."""
        got = await next_or_disconnect(lambda: anext(events), disconnected)
        if got is None:
            self._abandon(*bridges)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        error = got[1].error if isinstance(got[1], Finished) else None
        if error is not None:
            # A bug is already logged with its traceback by `_answered`: a 500 here, not a re-raise that
            # the app's handler (and the ASGI server) would log again.
            return failure_response(error, errors)
        return got  # type: ignore[return-value]

    async def _prepare(self, raw: bytes, surface: Surface, arrival: float, rid: str, namespace: str | None,
                       client: str, gone: CancelToken) -> Prepared:
        """Parse, tokenize and submit on the prepare pool; a request whose handler was cancelled is cancelled."""
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self.prepare_pool, self._preparer.prepare, raw, surface, loop,
                                          lambda bridge, final: self._answered(bridge, final, arrival, rid),
                                          namespace, client, gone, arrival)
        except RuntimeError:  # the pool is shut down: the server is stopping
            raise BatcherClosed() from None
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_cancel_orphan)
            raise

    def _abandon(self, *bridges: ReplyBridge) -> None:
        """The client is gone: cancel its requests the batcher has not answered yet (counted once)."""
        if [bridge.abandon() for bridge in bridges].count(True):
            self.metrics.client_disconnected()

    def _answered(self, bridge: ReplyBridge, final: Final, arrival: float, rid: str) -> None:
        """The batcher answered (on the loop thread): the request leaves the in-flight set, is counted and logged."""
        self.in_flight.discard(bridge)
        result, finished_at = final.result, final.finished_at if final.finished_at is not None else arrival
        if isinstance(result, GenerationResult):
            usage = result.usage
            log.info("request %s: %s, %d prompt (%s cached) + %d completion tokens in %.2f s", rid,
                     finish_reason(result.finish_reason), usage.prompt_tokens, usage.cached_tokens,
                     usage.completion_tokens, finished_at - arrival)
            self.metrics.request_finished(result, arrival=arrival, finished_at=finished_at,
                                          chunk_times=bridge.chunk_times)
        elif isinstance(final.error, DecodeError):
            log.info("request %s: refused, %s (%s)", rid, final.error.http_status, final.error.code)
            self.metrics.refused(final.error.code)
        else:
            self.metrics.refused("internal_error")
            log.error("a request failed outside the DecodeError family", exc_info=final.error)

    def abandon_all(self) -> None:
        """Cancel what is still in flight (its clients are gone by now); new submissions still go through."""
        for bridge in list(self.in_flight):
            bridge.abandon()

    def end_in_flight(self, error: DecodeError) -> int:
        """End every request still in flight with `error` (the drain ran out: `listener.DrainingServer`): each
        is cancelled, a stream gets `error` as its last event before `[DONE]`, a plain answer is `error`'s
        response. Returns how many it ended."""
        return [bridge.end(error) for bridge in list(self.in_flight)].count(True)

    async def shutdown(self) -> None:
        """Cancel what is still in flight (its clients are gone by now) and join the pools."""
        self.abandon_all()

        def join() -> None:
            self.prepare_pool.shutdown(wait=True, cancel_futures=True)
            self.answer_pool.shutdown(wait=True, cancel_futures=True)

        try:
            await asyncio.wait_for(asyncio.to_thread(join), SHUTDOWN_JOIN_SECS)
        except asyncio.TimeoutError:
            log.warning("shutdown: the pools were still busy after %.0f s", SHUTDOWN_JOIN_SECS)


def _answer(fmt: AnswerFormat, results: list[GenerationResult], best_of: int, n: int, asked: bool) -> Iterator[str]:
    """The whole answer's JSON text, in pieces (blocking: for the answer pool); `best_of` ranks each prompt's
    candidates there too."""
    chosen = [r for at in range(0, len(results), best_of) for r in best(results[at:at + best_of], n, asked)]
    yield from fmt.full(chosen, [r.usage for r in results])


def _cancel_orphan(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        for bridge in future.result().bridges:
            bridge.abandon()
