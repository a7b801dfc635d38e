"""`Request`: one generation request, from the handle's submit to its one reply.

The handle builds it (prompt, parameters, the blocks it was priced at, its
abort id, its reply sink) and sends it to the worker; the scheduler moves it
through its statuses and the model runner reads what it needs from it. It is
the only per-request state the worker keeps, so a new per-request field is
added here and nowhere else.

Statuses: WAITING (queued, holds a queue slot) -> PREFILLING (admitted: holds
its blocks and a KV lease; its prompt runs in chunks) -> DECODING (its prompt
is through; it samples one token per forward) -> FINISHED (answered, or about
to be by the scheduler's flush). Any state may end early: cancelled, refused
at admission, or failed.

`num_computed_tokens` counts the tokens whose KV the store holds: the prompt
chunks that ran, then each fed generated token. The KV store's own length is
checked against it after every forward, so the two cannot drift.

An empty prompt prefills one stand-in token (`0`): a forward is still needed
to get the logits the first token is sampled from.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ferrox_batch.admission.clock import RowClock
from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.errors import DecodeError, InternalError
from ferrox_batch.generation_types import FinishReason, GenerationParams, GenerationResult
from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.policy.stop import Matched, StopMatcher
from ferrox_batch.policy.utf8_stream import Utf8Stream
from ferrox_batch.prompt_logprobs import PromptLogprobs
from ferrox_batch.scheduler.ngram_draft import NgramIndex
from ferrox_batch.scheduler.sink import OnceSink
from ferrox_batch.stop_tokens import StopTokens
from ferrox_batch.structured import CompiledSpec
from ferrox_batch.usage import Usage

log = logging.getLogger("ferrox_batch.scheduler")

#: Detokenizes ids to raw bytes (a character may straddle tokens).
DecodeFn = Callable[[list[int]], bytes]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    prompt_tokens: list[int]
    params: GenerationParams
    stop_tokens: StopTokens
    sink: OnceSink
    abort: int  # the id `AbortInbox` cancels it by
    blocks: int  # what its lease costs in blocks: what admission would reserve with nothing cached
    positions: int  # KV positions its lease holds: what `blocks` was priced from
    status: RequestStatus = RequestStatus.WAITING
    queued_at: float = 0.0  # when it was submitted (the scheduler's clock, monotonic seconds)
    deadline: float | None = None  # admission after this time is refused (`QueueTimeout`); None: never
    #: The abort id of a request whose prompt this one repeats (another choice of one prompt): it is
    #: admitted only once that prompt is through, so it adopts the prompt's cached blocks. None: no one.
    after: int | None = None
    #: The compiled grammar its output follows (`GenerationParams.structured`, compiled at submit); opaque here.
    grammar: CompiledSpec | None = None
    #: Its sampling bias as the runtime prepared it at submit, on the caller's thread (shared by a request's
    #: choices); opaque here. None: the runtime builds it when the row is made.
    bias: object = None
    #: The window its lease slides by, giving back the pages behind it (`admission.window`; priced at the
    #: hold bound, not every position). None: its lease keeps every position.
    window: WindowPolicy | None = None
    seq_id: int | None = None  # its KV lease, from admission on
    skips: int = 0  # times the cache-aware pick admitted a later request first (bounded)
    reserved: int = 0  # blocks admission reserved: `blocks` less the cached ones it adopted that others use
    num_computed_tokens: int = 0
    #: Prompt tokens adopted from the prefix cache, not computed; None when the batcher has no cache.
    cached_tokens: int | None = None
    output_ids: list[int] = field(default_factory=list)
    #: One entry per output id when the request asked for log-probabilities (else None); `logprobs_sent`
    #: of them went out with chunks already.
    logprobs: list[TokenLogprob] | None = None
    logprobs_sent: int = 0
    #: When asked for (`params.prompt_logprobs`): None for the first prompt token, then one entry per prompt
    #: token as the chunks that predict them run, held as arrays (`PromptLogprobs`), not as objects.
    prompt_logprobs: PromptLogprobs | None = None
    clock: RowClock | None = None
    #: Its stop matcher: built at submit on the caller's thread (`ContinuousBatcher.submit`), else at admission.
    stops: StopMatcher | None = None
    utf8: Utf8Stream = field(default_factory=Utf8Stream)
    visible: list[str] = field(default_factory=list)
    finish: FinishReason | None = None
    error: DecodeError | None = None
    #: Special tokens' own texts, for a request that keeps them (`params.skip_special_tokens` False).
    special_texts: Mapping[int, bytes] | None = None
    #: The stop token that ended it (left out of `output_ids`).
    stop_token_id: int | None = None
    ids_sent: int = 0  # output ids that went out with chunks (`params.stream_token_ids`)
    #: Speculative decoding (`scheduler.speculation`): this step's draft, the n-gram index it is looked up in,
    #: the next draft's most tokens (0: not yet set), how many drafts in a row were rejected whole, the
    #: steps it still sits out after too many, and how many such pauses came since it last kept a token.
    draft: tuple[int, ...] = ()
    ngram: NgramIndex | None = None
    draft_limit: int = 0
    draft_misses: int = 0
    draft_pause: int = 0
    draft_pauses: int = 0
    #: Text held back while a verified draft's tokens are applied, so they stream as one chunk (else None).
    held_text: list[str] | None = None
    #: Its prompt's pooled hidden states so far (`params.pooling`): the sum over the chunks run ("mean"),
    #: or the last chunk's last row ("last").
    pooled: list[float] | None = None

    @property
    def held_ids(self) -> tuple[int, ...]:
        """The ids it may not sample before `params.min_tokens` tokens: its stop tokens (the model's, unless
        it ignores EOS) and its own stop ids."""
        if not self.params.min_tokens:
            return ()
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids.update(self.stop_tokens.ids)
        return tuple(sorted(ids))

    @property
    def priority(self) -> int:
        """Admission order: lower first (`GenerationParams.priority`)."""
        return self.params.priority

    def queued(self, now: float, default_wait_ms: int | None) -> None:
        """Stamp its arrival at `now` and its queue deadline: its own `max_queue_wait_ms`, else the batcher's."""
        self.queued_at = now
        wait_ms = self.params.max_queue_wait_ms if self.params.max_queue_wait_ms is not None else default_wait_ms
        self.deadline = None if wait_ms is None else now + wait_ms / 1000

    # ------------------------------------------------------------ prompt

    @property
    def cacheable_tokens(self) -> list[int]:
        """The tokens it may adopt cached blocks for: none when its prompt's log-probabilities are wanted,
        since those are read from the prompt's own forward, nor when its lease slides (a sliding lease
        recycles its own pages behind the window, so none of them may be shared)."""
        if self.params.prompt_logprobs is not None or self.params.pooling is not None or self.window is not None:
            return []
        return self.prefill_tokens

    @property
    def samples(self) -> bool:
        """Whether it samples after its prompt (a scoring request with `max_tokens=0` only runs its prompt)."""
        return self.params.max_tokens > 0

    @property
    def prefill_tokens(self) -> list[int]:
        """What the prefill feeds the model: the prompt, or the stand-in `[0]` for an empty one."""
        return self.prompt_tokens if self.prompt_tokens else [0]

    def prefill_remaining(self) -> int:
        return max(0, len(self.prefill_tokens) - self.num_computed_tokens)

    def computed_tokens(self) -> list[int]:
        """The tokens whose KV the store holds, from position 0 (the last sampled token is never fed)."""
        return (self.prefill_tokens + self.output_ids)[:self.num_computed_tokens]

    def next_prompt_chunk(self, budget: int) -> list[int]:
        start = self.num_computed_tokens
        return self.prefill_tokens[start:start + budget]

    def add_pooled(self, state: list[float]) -> None:
        """A chunk's pooled hidden states (`StepOutput.pooled`): summed into the mean's total, or the last."""
        if self.pooled is None or self.params.pooling == "last":
            self.pooled = list(state)
        else:
            self.pooled = [a + b for a, b in zip(self.pooled, state)]

    def embedding(self) -> tuple[float, ...] | None:
        """Its prompt's embedding once the prompt is through (the mean divides by its length); None if not asked."""
        if self.pooled is None:
            return None
        if self.params.pooling == "mean":
            n = len(self.prefill_tokens)
            return tuple(v / n for v in self.pooled)
        return tuple(self.pooled)

    # ------------------------------------------------------------ lifecycle

    def stop_matcher(self) -> StopMatcher:
        """Its stop strings and stop-token ids as the matcher a decoding row holds (made before its lease,
        so a matcher that cannot be built leaves no lease behind)."""
        return StopMatcher(self.params.stop, self.params.all_stop_ids)

    def admitted(self, seq_id: int, now: Callable[[], float], stops: StopMatcher | None = None) -> None:
        """Admitted with a KV lease; its row is timed on `now`, the clock its queue time was stamped on.
        `stops`: its `stop_matcher()`, made here when not given."""
        self.seq_id = seq_id
        self.status = RequestStatus.PREFILLING
        self.clock = RowClock.start(now)
        self.stops = stops if stops is not None else self.stop_matcher()

    def prompt_done(self) -> None:
        self.status = RequestStatus.DECODING
        assert self.clock is not None
        self.clock.prefill_finished()

    @property
    def going(self) -> bool:
        """Still generating: not finished, cancelled or failed."""
        return self.finish is None

    def fail(self, error: DecodeError) -> None:
        """Stop with an error; the request leaves through the scheduler's flush, which replies with it."""
        self.finish = FinishReason.STOP
        self.error = error

    def cancel(self) -> None:
        if self.finish is None:
            self.finish = FinishReason.CANCELLED

    # ------------------------------------------------------------ output

    def hold_chunks(self) -> None:
        """Gather what `emit` streams until `release_chunks` (the tokens one forward accepted at once)."""
        self.held_text = []

    def release_chunks(self) -> None:
        """Stream what was gathered since `hold_chunks` as one chunk."""
        held, self.held_text = self.held_text, None
        if held:
            self.emit("".join(held))

    def emit(self, text: str) -> None:
        """Stream visible text, with the log-probabilities of the tokens generated since the last chunk."""
        if text and self.held_text is not None:
            self.held_text.append(text)
        elif text:
            self.visible.append(text)
            fresh: tuple[TokenLogprob, ...] = ()
            if self.logprobs is not None:
                fresh = tuple(self.logprobs[self.logprobs_sent:])
                self.logprobs_sent = len(self.logprobs)
            ids: tuple[int, ...] = ()
            if self.params.stream_token_ids:
                ids = tuple(self.output_ids[self.ids_sent:])
                self.ids_sent = len(self.output_ids)
            if not self.sink.chunk(text, fresh, ids):
                self.cancel()  # nobody can read what it would generate

    def _apply_stop_buffer(self, piece: str) -> bool:
        """Feed decoded text to the stop matcher; True when a stop string matched (the request is finished).
        No stop may end in the text of its first `min_tokens` tokens."""
        assert self.stops is not None
        if len(self.output_ids) <= self.params.min_tokens:
            self.emit(self.stops.push_unmatched(piece).text)
            return False
        step = self.stops.push(piece)
        if isinstance(step, Matched):
            self.emit(step.text + step.stop if self.params.include_stop_str_in_output else step.text)
            self.finish = FinishReason.stop_sequence(step.stop)
            return True
        self.emit(step.text)
        return False

    def _early_stop_string(self, token: int) -> bool:
        """Whether `token` is a one-token stop string sampled before `min_tokens`: text, not a stop (stop ids
        are banned until then; a stop string may not end the output before it)."""
        return (len(self.output_ids) < self.params.min_tokens and token in self.params.stop_string_ids
                and token not in self.params.stop_token_ids
                and (self.params.ignore_eos or token not in self.stop_tokens))

    def _render(self, token: int, decode: DecodeFn) -> bytes:
        """The token's bytes: the detokenizer's, or a kept special token's own text."""
        if self.special_texts is not None:
            special = self.special_texts.get(token)
            if special is not None:
                return special
        return decode([token])

    def push_token(self, token: int, decode: DecodeFn, logprob: TokenLogprob | None = None) -> bool:
        """Apply one sampled token; True when the request goes on (the token must be fed to the model).

        A stop token ends the request and is not part of the output; a detokenizer failure fails
        this request only (`InternalError`), never the worker.
        """
        assert self.stops is not None and self.clock is not None
        if ((not self.params.ignore_eos and token in self.stop_tokens) or self.stops.is_stop_token(token)) \
                and not self._early_stop_string(token):
            self.finish = FinishReason.STOP
            self.stop_token_id = token
            if self.params.include_stop_str_in_output:
                self._include_stop_token(token, decode)
            return False
        self.output_ids.append(token)
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
        self.clock.token()
        try:
            text = self._render(token, decode)
        except Exception as bad:  # one request's detokenizer failure is its own fault, not the worker's
            log.exception("decode failed")
            self.fail(InternalError(f"decoding token {token} failed: {type(bad).__name__}: {bad}"))
            return False
        piece = self.utf8.push(text)
        if piece and self._apply_stop_buffer(piece):
            return False
        if self.finish is not None:  # its sink refused a chunk
            return False
        if len(self.output_ids) >= self.params.max_tokens:
            # The last token is not fed: its logits would be discarded (the upstream feeds it anyway).
            self.finish = FinishReason.LENGTH
            return False
        return True

    def _include_stop_token(self, token: int, decode: DecodeFn) -> None:
        """The stop token's text as the output's last text (`include_stop_str_in_output`): what the stop
        matcher withholds goes first, as it can no longer become a stop."""
        assert self.stops is not None
        try:
            text = self.utf8.push(self._render(token, decode)) + self.utf8.flush()
        except Exception as bad:
            log.exception("decode failed")
            self.fail(InternalError(f"decoding token {token} failed: {type(bad).__name__}: {bad}"))
            return
        self.emit(self.stops.flush() + text)

    def reply(self) -> None:
        """Send the one final event: the error, or the result with whatever text the stream still holds."""
        decoded = self.status is RequestStatus.DECODING
        self.status = RequestStatus.FINISHED
        if self.error is not None:
            self.sink.finished(self.error)
            return
        if self.stops is not None and (self.finish is None or self.finish.kind != "stop_sequence"):
            # A character left incomplete at the end is emitted as U+FFFD (through the stop matcher)
            # instead of being dropped, unlike the upstream. After a stop string matched, whatever
            # followed it is dropped, as the upstream does.
            partial = self.utf8.flush()
            if partial:
                self.emit(self.stops.push(partial).text)
            self.emit(self.stops.flush())
        finish = self.finish if self.finish is not None else FinishReason.STOP
        if decoded and self.clock is not None:
            usage = self.clock.usage(len(self.prompt_tokens), len(self.output_ids))
        else:  # ended before its prompt was through (cancelled): counts, no rates
            usage = Usage.new(len(self.prompt_tokens), 0)
        if self.cached_tokens is not None:
            usage = usage.with_cached_tokens(min(self.cached_tokens, len(self.prompt_tokens)))
        if self.clock is not None:
            usage = usage.with_queue_time(max(0.0, self.clock.started - self.queued_at))
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = tuple(self.logprobs or ())
        prompt = self.prompt_logprobs  # handed on whole: the answer reads it a slice at a time
        self.sink.finished(GenerationResult(finish, list(self.output_ids), "".join(self.visible), usage, logprobs,
                                            prompt, self.stop_token_id, self.embedding()))

    def answer(self, outcome: GenerationResult | DecodeError) -> None:
        """Reply with `outcome` as it is (a refusal, or a result decided without running)."""
        self.status = RequestStatus.FINISHED
        self.sink.finished(outcome)
