"""The sampling and stopping fields both generation endpoints share, read into `SamplingOptions`.

Each is type-checked here; ranges are checked by `SamplingParams` / `GenerationParams` themselves, so the
server and the library refuse exactly the same values with the same messages. Log-probabilities differ
by endpoint (completions' `logprobs` is a count, chat's a switch with `top_logprobs`), hence two readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrox_batch.checks import UNLIMITED
from ferrox_batch.engine.text import text_params
from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import GenerationParams, SamplingParams
from ferrox_batch.logprobs import MAX_TOP_LOGPROBS
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.stop_limits import DEFAULT_MAX_STOP_CHARS
from ferrox_batch.server.extra_fields import ExtraSampling, read_extra_sampling
from ferrox_batch.server.fields import Fields, is_number
from ferrox_batch.structured import StructuredOutput

#: OpenAI's temperature default. The library's default is greedy; an HTTP client that omits
#: the field expects OpenAI's behaviour.
DEFAULT_TEMPERATURE = 1.0
#: The most digits a `logit_bias` key may have: every token id is below 2**31, which has ten. A longer key
#: is refused before it is read as an integer (past 4,300 digits Python refuses the conversion itself).
MAX_TOKEN_ID_DIGITS = 10


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """The sampling and stopping fields both endpoints share, already range-checked."""

    sampling: SamplingParams
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    #: The prefix cache's namespace (vLLM's field): requests share cached prompt blocks only within one.
    cache_salt: str | None = None
    #: Admission order (vLLM's field): lower first, arrival order within one.
    priority: int = 0
    #: Refused with 503 queue_timeout if still waiting for admission after this long (the server's default
    #: when None).
    max_queue_wait_ms: int | None = None
    #: Alternatives per token when the request asked for log-probabilities; None: it did not.
    logprobs: int | None = None
    #: The same for the prompt's tokens (completions' `echo` with `logprobs`).
    prompt_logprobs: int | None = None
    #: What the output must be (chat's `response_format`); None: free text.
    structured: StructuredOutput | None = None
    #: vLLM's extra fields for stopping, banning and writing the output (`extra_fields`).
    extra: ExtraSampling = ExtraSampling()
    #: Whether streamed chunks carry their tokens' ids (`return_token_ids` on a stream).
    stream_token_ids: bool = False
    #: An embedding's pooling (`/v1/embeddings`); None: a generation.
    pooling: str | None = None

    def generation_params(self, tokenizer: Tokenizer, max_tokens: int,
                          max_stop_chars: int = DEFAULT_MAX_STOP_CHARS) -> GenerationParams:
        """Params for the batcher; stop strings that are one token are also stopped on by id;
        `max_stop_chars`: the server's bound on the stop strings' characters in all (`--max-stop-chars`)."""
        return text_params(tokenizer, max_tokens=max_tokens, stop=self.stop, max_stop_chars=max_stop_chars,
                           seed=self.seed,
                           ignore_eos=self.ignore_eos, sampling=self.sampling, cache_salt=self.cache_salt,
                           priority=self.priority, max_queue_wait_ms=self.max_queue_wait_ms,
                           logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                           structured=self.structured, stream_token_ids=self.stream_token_ids, pooling=self.pooling,
                           **self.extra.keywords())


def read_options(fields: Fields, logprobs: int | None) -> SamplingOptions:
    top_k = fields.integer("top_k", 0)
    if top_k == -1:  # vLLM's spelling of "disabled"; clients written for it send it
        top_k = 0
    extra = read_extra_sampling(fields)
    sampling = SamplingParams(  # raises InvalidRequest naming the first out-of-range field
        temperature=fields.number("temperature", DEFAULT_TEMPERATURE),
        top_p=fields.number("top_p", 1.0),
        top_k=top_k,
        min_p=fields.number("min_p", 0.0),
        repetition_penalty=fields.number("repetition_penalty", 1.0),
        presence_penalty=fields.number("presence_penalty", 0.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0),
        logit_bias=_logit_bias(fields.raw("logit_bias")),
        allowed_token_ids=extra.allowed_token_ids,
    )
    seed = fields.integer("seed", None)
    if seed is not None and not 0 <= seed <= UNLIMITED:
        raise InvalidRequest("seed", seed, "must be an integer in [0, 2**64 - 1]")
    salt = fields.raw("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequest("cache_salt", salt, "must be a non-empty string")
    # Ranges are GenerationParams' to check, as for every other field.
    return SamplingOptions(sampling=sampling, seed=seed, stop=_stop(fields.raw("stop")),
                           ignore_eos=fields.boolean("ignore_eos", False), cache_salt=salt,
                           priority=fields.integer("priority", 0),
                           max_queue_wait_ms=fields.integer("max_queue_wait_ms", None), logprobs=logprobs,
                           extra=extra)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` (JSON keys are strings) as (id, bias) pairs; ranges are SamplingParams'."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias", value, "must be an object mapping token ids to numbers")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise InvalidRequest("logit_bias", key, "keys must be token ids (decimal integers)")
        if len(key) > MAX_TOKEN_ID_DIGITS:
            raise InvalidRequest("logit_bias", key, f"keys must be token ids of at most {MAX_TOKEN_ID_DIGITS} digits")
        if not is_number(bias):
            raise InvalidRequest("logit_bias", bias, "values must be numbers in [-100, 100]")
        pairs.append((int(key), bias))
    return tuple(sorted(pairs))


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise InvalidRequest("stop", value, "must be a string or a list of strings")


def completion_logprobs(fields: Fields) -> int | None:
    """Completions' `logprobs`: how many alternatives per token (0 still asks for the sampled token's);
    `false`, which some clients send, asks for none."""
    if fields.raw("logprobs") is False:
        return None
    return fields.integer("logprobs", None)  # the range is GenerationParams' to check


def chat_logprobs(fields: Fields) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs: k` (0 to 20) alternatives per token."""
    top = fields.integer("top_logprobs", None)
    if not fields.boolean("logprobs", False):
        if top:
            raise InvalidRequest("top_logprobs", top, "needs logprobs: true")
        return None
    top = 0 if top is None else top
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest("top_logprobs", top, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    return top
