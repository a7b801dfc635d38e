"""The vocabulary a request and its answer are written in: `FinishReason`,
`SamplingParams`, `GenerationParams` and `GenerationResult`.

Every layer speaks these types -- the batcher's handle and worker, the HTTP
server, the CLI and the benchmarks -- so they live in one small module that
imports neither torch nor the scheduler, and any of those layers can import
it without pulling in the others. `FinishReason` is defined in
`ferrox_batch.finish_reason` and re-exported here, so either import works.
The failures a request can end in are the `DecodeError` family in
`ferrox_batch.errors`; the token counts and timings of an answer are
`ferrox_batch.usage.Usage`.

Python shape of these values:

* They are frozen dataclasses and compare by value.
* Inputs a stricter type system would make impossible (a negative
  `max_tokens`, a non-integer seed) are checked on construction:
  `GenerationParams` and `SamplingParams` raise `InvalidRequest` (HTTP 400,
  also a `ValueError`) naming the field and the value.
* Python ints are unbounded, so positions are bounded by
  `checks.UNLIMITED = 2**64 - 1`; a `prompt + max_tokens` above it is refused
  as an overflow (see `budget.ContextCeiling.overflow_refusal`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ferrox_batch.cancel import CancelToken
from ferrox_batch.checks import UNLIMITED, encodable
from ferrox_batch.errors import InvalidRequest
from ferrox_batch.finish_reason import FinishReason
from ferrox_batch.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from ferrox_batch.prompt_logprobs import PromptLogprobs
from ferrox_batch.stop_limits import DEFAULT_MAX_STOP_CHARS, check_stop_limits
from ferrox_batch.structured import StructuredOutput
from ferrox_batch.token_constraints import check_token_lists
from ferrox_batch.usage import Usage

__all__ = ["FinishReason", "SamplingParams", "GenerationParams", "GenerationResult"]

# ---------------------------------------------------------------------------
# Request parameters (docs/upstream.md, Request parameters and sampling)
# ---------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: The largest finite float32, and the smallest normal one: the sampler computes in float32, so a value
#: past the first overflows to infinity there and a non-zero one below the second loses its precision or
#: becomes 0 (a division by it overflows).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38


def _is_number(value: object) -> bool:
    """A finite number that keeps its meaning in float32: 0, or a magnitude in [FLOAT32_TINY, FLOAT32_MAX]
    (a bool is not a number)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value == 0 or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX))


#: OpenAI's bound on each `logit_bias` value: -100 bans a token in practice, 100 all but forces it.
LOGIT_BIAS_LIMIT = 100

#: How an embedding pools a prompt's final hidden states (`GenerationParams.pooling`).
POOLING = ("last", "mean")

#: The priorities a request may ask for: a 32-bit range, as wide as any client sends.
PRIORITY_LIMIT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampler settings; the defaults are greedy with every filter off (upstream `SamplingParams::default()`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: (token id, bias) pairs added to those tokens' logits before sampling (OpenAI's `logit_bias`, each
    #: in [-100, 100]); a mapping is stored as pairs sorted by id.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Only these ids may be sampled (vLLM's `allowed_token_ids`); None: any. Stored sorted, each id once (a
    #: repeated id collapses, as in vLLM).
    allowed_token_ids: tuple[int, ...] | None = None
    #: Token sequences the output never contains (`token_constraints`: vLLM's `bad_words`, tokenized).
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        elif isinstance(self.logit_bias, Iterable) and not isinstance(self.logit_bias, (str, bytes)):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias))
        if isinstance(self.allowed_token_ids, Iterable) and not isinstance(self.allowed_token_ids, (str, bytes)):
            ids = tuple(self.allowed_token_ids)
            if all(_is_int(t) for t in ids):  # the ids name a set, as vLLM reads them: repeats collapse
                ids = tuple(sorted(set(ids)))
            object.__setattr__(self, "allowed_token_ids", ids)
        if isinstance(self.bad_words_ids, Iterable) and not isinstance(self.bad_words_ids, (str, bytes)):
            object.__setattr__(self, "bad_words_ids", tuple(tuple(w) if isinstance(w, Iterable) else w
                                                            for w in self.bad_words_ids))
        self.validate()

    def validate(self) -> None:
        """Raise `InvalidRequest` naming the first out-of-range field."""
        t = self.temperature
        if not _is_number(t) or t < 0:
            raise InvalidRequest("temperature", t, "must be a finite number >= 0 (float32: 0 or in [1.2e-38, 3.4e38])")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", self.top_p, "must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequest("min_p", self.min_p, "must be a number in [0, 1]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty", self.repetition_penalty, "must be a number > 0 within float32's range [1.2e-38, 3.4e38] (1.0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidRequest(name, value, "must be a number in [-2, 2]")
        if not isinstance(self.logit_bias, tuple):
            raise InvalidRequest("logit_bias", self.logit_bias, "must map token ids to numbers in [-100, 100]")
        seen = set()
        for pair in self.logit_bias:
            if len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0:
                raise InvalidRequest("logit_bias", pair, "keys must be token ids (integers >= 0)")
            if not _is_number(pair[1]) or not -LOGIT_BIAS_LIMIT <= pair[1] <= LOGIT_BIAS_LIMIT:
                raise InvalidRequest("logit_bias", pair, f"values must be numbers in [-{LOGIT_BIAS_LIMIT}, "
                                                         f"{LOGIT_BIAS_LIMIT}]")
            if pair[0] in seen:
                raise InvalidRequest("logit_bias", pair, "names a token id twice")
            seen.add(pair[0])
        check_token_lists(self.allowed_token_ids, self.bad_words_ids)

    @property
    def token_ids_named(self) -> list[int]:
        """Every id its bias, allowed list and bad words name (for the batcher's vocabulary check)."""
        return [*(t for t, _ in self.logit_bias), *(self.allowed_token_ids or ()),
                *(t for word in self.bad_words_ids for t in word)]

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 means argmax (penalties may still reshape the logits first)."""
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What one request asks for. Validated on construction (`InvalidRequest` on a bad field).

    `stop` and `stop_token_ids` accept any iterable and are stored as tuples;
    a bare string for `stop` is one stop string (as in the OpenAI API), not a
    list of characters.
    """

    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    cancel: CancelToken | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    #: Admission order (vLLM's field): a lower value is admitted first; equal values keep arrival order.
    priority: int = 0
    #: Log-probabilities of each generated token with this many most likely alternatives (0 to
    #: `MAX_TOP_LOGPROBS`); None: none are computed, and the request costs nothing extra.
    logprobs: int | None = None
    #: The same for each prompt token after the first (its log-probability given the tokens before it),
    #: for scoring text; the prompt is then computed whole (no cached prefix is adopted), and a request
    #: with `max_tokens=0` runs its prompt and stops.
    prompt_logprobs: int | None = None
    #: What the output must be (JSON mode or a JSON schema), enforced token by token; None: anything.
    structured: StructuredOutput | None = None
    #: Milliseconds this request may wait for admission before it is refused with `QueueTimeout`
    #: (None: the batcher's `max_queue_wait_ms`, which may itself be None: no limit).
    max_queue_wait_ms: int | None = None
    #: Tokens generated before a stop token may be sampled or a stop string may end the output (vLLM's
    #: `min_tokens`): the stop ids are banned until then, and a stop string must end after that token.
    min_tokens: int = 0
    #: Whether the stop string (or the stop token's text) that ended the output is part of its text.
    include_stop_str_in_output: bool = False
    #: Whether special tokens (`<|im_end|>`, `<think>` where it is one) are left out of the text.
    skip_special_tokens: bool = True
    #: vLLM's flag for a space between special tokens kept in the text. This detokenizer writes each
    #: token's own text and never a space between added tokens, which is what `False` asks and what
    #: `True` gives for a fast (tokenizer.json) tokenizer in vLLM; it is accepted for both.
    spaces_between_special_tokens: bool = True
    #: Whether each streamed chunk carries the ids of the tokens generated since the last one.
    stream_token_ids: bool = False
    #: An embedding of the prompt instead of an answer: its final hidden states pooled, "mean" (over every
    #: position) or "last" (the last position's); the request runs its prompt only (`max_tokens` 0).
    pooling: str | None = None
    #: The stop strings that are one token, also stopped on by id (`engine.text.text_params` resolves
    #: them); unlike `stop_token_ids` they are stop strings, so `min_tokens` neither bans them nor lets
    #: them end the output early.
    stop_string_ids: tuple[int, ...] = ()
    #: Characters its stop strings may hold in all: their matcher's memory and build time grow with them
    #: (`stop_limits`). The library's default is the server's; a server passes its `--max-stop-chars`.
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, Iterable):
            object.__setattr__(self, "stop", tuple(self.stop))
        for name in ("stop_token_ids", "stop_string_ids"):
            value = getattr(self, name)
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    def validate(self) -> None:
        """Raise `InvalidRequest` naming the first bad field."""
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise InvalidRequest("max_tokens", self.max_tokens, "must be a non-negative integer")
        if self.max_tokens > UNLIMITED:
            raise InvalidRequest("max_tokens", self.max_tokens, f"must be at most 2**64 - 1 ({UNLIMITED})")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequest("sampling", self.sampling, "must be a SamplingParams")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= UNLIMITED):
            raise InvalidRequest("seed", self.seed, "must be None or an integer in [0, 2**64 - 1]")
        if not isinstance(self.stop, tuple):
            raise InvalidRequest("stop", self.stop, "must be a string or a list of strings")
        for s in self.stop:
            if not isinstance(s, str):
                raise InvalidRequest("stop", s, "entries must be strings")
        if not isinstance(self.stop_token_ids, tuple):
            raise InvalidRequest("stop_token_ids", self.stop_token_ids, "must be a list of integers")
        for name in ("stop_token_ids", "stop_string_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple):
                raise InvalidRequest(name, ids, "must be a list of integers")
            for t in ids:
                if not _is_int(t) or t < 0:
                    raise InvalidRequest(name, t, "entries must be integers >= 0")
        if not _is_int(self.max_stop_chars) or self.max_stop_chars < 1:
            raise InvalidRequest("max_stop_chars", self.max_stop_chars, "must be a positive integer")
        check_stop_limits(self.stop, self.all_stop_ids, self.max_stop_chars)
        if self.cancel is not None and not isinstance(self.cancel, CancelToken):
            raise InvalidRequest("cancel", self.cancel, "must be a CancelToken or None")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest("ignore_eos", self.ignore_eos, "must be a bool")
        # An empty salt would be a namespace of its own that reads as "no salt"; refusing it keeps
        # the two spellings of "shared with every unsalted request" down to one (None).
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequest("cache_salt", self.cache_salt, "must be a non-empty string or None")
        if not _is_int(self.priority) or not -PRIORITY_LIMIT <= self.priority <= PRIORITY_LIMIT:
            raise InvalidRequest("priority", self.priority,
                                 f"must be an integer in [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}]")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequest("logprobs", self.logprobs,
                                 f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token)")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise InvalidRequest("structured", self.structured, "must be a StructuredOutput or None")
            if self.ignore_eos:
                raise InvalidRequest("ignore_eos", True, "cannot be combined with structured output, which ends "
                                                         "where its grammar does")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequest("prompt_logprobs", self.prompt_logprobs,
                                 f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token)")
        if self.max_queue_wait_ms is not None and (not _is_int(self.max_queue_wait_ms)
                                                   or not 1 <= self.max_queue_wait_ms <= UNLIMITED):
            raise InvalidRequest("max_queue_wait_ms", self.max_queue_wait_ms,
                                 "must be None or a positive integer number of milliseconds")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest("min_tokens", self.min_tokens,
                                 f"must be an integer in [0, max_tokens] (max_tokens is {self.max_tokens})")
        if self.pooling is not None:
            if self.pooling not in POOLING:
                raise InvalidRequest("pooling", self.pooling, f"must be one of {', '.join(POOLING)}")
            if self.max_tokens != 0:
                raise InvalidRequest("max_tokens", self.max_tokens, "must be 0 for an embedding (pooling)")
        if self.min_tokens and self.structured is not None:
            raise InvalidRequest("min_tokens", self.min_tokens, "cannot be combined with structured output, which "
                                                               "ends where its grammar does")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "stream_token_ids"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(name, getattr(self, name), "must be a bool")
        # Strings reach the prefix cache's hashes and the stop matcher as UTF-8: a lone surrogate is
        # refused here, on the caller's thread, never met on the worker.
        for name, texts in (("cache_salt", () if self.cache_salt is None else (self.cache_salt,)),
                            ("stop", self.stop)):
            for text in texts:
                if not encodable(text):
                    raise InvalidRequest(name, text, "must be valid Unicode text (it holds a lone surrogate)")

    @property
    def all_stop_ids(self) -> tuple[int, ...]:
        """Every id it stops on (its own stop ids, then its one-token stop strings')."""
        return self.stop_token_ids + tuple(t for t in self.stop_string_ids if t not in self.stop_token_ids)

    def is_cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_cancelled()

    def with_max_tokens(self, max_tokens: int) -> GenerationParams:
        """A copy with another generation budget (the context ceiling's clamp: docs/upstream.md, ContextCeiling); the cancel token is shared, not copied."""
        return dataclasses.replace(self, max_tokens=max_tokens)


# ---------------------------------------------------------------------------
# Result
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A successful generation; also unpacks as upstream's `(finish, ids, text, usage)` tuple.

    `text` is the stop-trimmed visible text; prefer it over re-decoding ids.
    """

    finish_reason: FinishReason
    token_ids: tuple[int, ...]
    text: str
    usage: Usage
    #: One entry per id of `token_ids` when the request asked for log-probabilities; else None.
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: One entry per prompt token when the request asked for them (None for the first, which nothing
    #: predicts); else None. The batcher hands a `PromptLogprobs` (its entries held as arrays, each made
    #: when read); any other sequence is stored as a tuple.
    prompt_logprobs: Sequence[TokenLogprob | None] | None = None
    #: The stop token that ended it (an EOS or a `stop_token_ids` entry), which `token_ids` leaves out;
    #: None when it ended otherwise.
    stop_token_id: int | None = None
    #: The prompt's pooled final hidden states, when it asked for an embedding (`GenerationParams.pooling`).
    embedding: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.finish_reason, FinishReason):
            raise TypeError(f"finish_reason must be a FinishReason, got {self.finish_reason!r}")
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if not isinstance(self.text, str):
            raise TypeError(f"text must be a string, got {self.text!r}")
        if not isinstance(self.usage, Usage):
            raise TypeError(f"usage must be a Usage, got {self.usage!r}")
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", tuple(self.logprobs))
            if len(self.logprobs) != len(self.token_ids):
                raise ValueError(f"logprobs must have one entry per token id: {len(self.logprobs)} for "
                                 f"{len(self.token_ids)} ids")
        if self.prompt_logprobs is not None and not isinstance(self.prompt_logprobs, PromptLogprobs):
            object.__setattr__(self, "prompt_logprobs", tuple(self.prompt_logprobs))

    def __iter__(self) -> Iterator[Any]:
        return iter((self.finish_reason, self.token_ids, self.text, self.usage))

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> Any:
        return (self.finish_reason, self.token_ids, self.text, self.usage)[index]
