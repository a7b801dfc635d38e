"""Text in, text out: the convenience layer over the token-level batcher API.

`generate_text` tokenizes a prompt (or renders chat messages with the
checkpoint's template), builds `GenerationParams` from keyword arguments,
resolves stop strings, and calls the batcher. Stop strings that are exactly
one token are also stopped on by id: that is the only way a stop string
naming a special token (say `<|im_end|>`, which decodes to no text) can ever
match; the text matcher still handles every other stop string.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from ferrox_batch.cancel import CancelToken
from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import GenerationParams, GenerationResult, SamplingParams
from ferrox_batch.policy.stop import resolve_stop_tokens
from ferrox_batch.runtime.loading.chat_template import ChatMessage
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.stop_limits import DEFAULT_MAX_STOP_CHARS
from ferrox_batch.structured import StructuredOutput
from ferrox_batch.token_constraints import bad_words_ids

Messages = Sequence[ChatMessage | Mapping[str, Any]]


def prompt_ids(tokenizer: Tokenizer, prompt: str | Messages) -> list[int]:
    """Token ids of a plain prompt (with the tokenizer's BOS rule) or of chat messages (templated)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        try:
            return tokenizer.encode_chat(prompt)
        except ValueError as bad:
            raise InvalidRequest("messages", prompt, str(bad)) from None
    raise InvalidRequest("prompt", prompt, "must be a string or a list of chat messages")


def text_params(
    tokenizer: Tokenizer,
    *,
    max_tokens: int,
    stop: str | Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    seed: int | None = None,
    ignore_eos: bool = False,
    cancel: CancelToken | None = None,
    sampling: SamplingParams | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
    max_queue_wait_ms: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured: StructuredOutput | None = None,
    min_tokens: int = 0,
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    stream_token_ids: bool = False,
    bad_words: Sequence[str] = (),
    pooling: str | None = None,
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS,
    **sampling_fields: Any,
) -> GenerationParams:
    """`GenerationParams` for text: stop strings that are one token also stop by id, and `bad_words` are
    tokenized into the sampling's `bad_words_ids` (`token_constraints`).

    Sampling comes as a ready `SamplingParams` or as its fields (`temperature=...`), not both.
    `max_stop_chars`: the characters `stop` may hold in all (a server passes its `--max-stop-chars`).
    """
    if sampling is None:
        sampling = SamplingParams(**sampling_fields)
    elif sampling_fields:
        raise TypeError(f"pass sampling or its fields, not both (got sampling and {sorted(sampling_fields)})")
    if bad_words:
        words = bad_words_ids(bad_words, lambda s: tokenizer.encode(s, add_special_tokens=False))
        sampling = dataclasses.replace(sampling, bad_words_ids=sampling.bad_words_ids + words)
    # Every field is checked before any stop string is tokenized: the stops' count, length and text are
    # bounded before the tokenizer sees them.
    params = GenerationParams(
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        cancel=cancel,
        ignore_eos=ignore_eos,
        cache_salt=cache_salt,
        priority=priority,
        max_queue_wait_ms=max_queue_wait_ms,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
        min_tokens=min_tokens,
        include_stop_str_in_output=include_stop_str_in_output,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        stream_token_ids=stream_token_ids,
        pooling=pooling,
        max_stop_chars=max_stop_chars,
    )
    ids = resolve_stop_tokens(params.stop, lambda s: tokenizer.encode(s, add_special_tokens=False))
    return dataclasses.replace(params, stop_string_ids=tuple(ids))


def generate_text(
    batcher,
    tokenizer: Tokenizer,
    prompt: str | Messages,
    *,
    max_tokens: int = 128,
    on_chunk: Callable[[str], None] | None = None,
    **options: Any,
) -> GenerationResult:
    """Generate from text or chat messages; `options` are `text_params`' keywords (sampling included)."""
    ids = prompt_ids(tokenizer, prompt)
    try:
        params = text_params(tokenizer, max_tokens=max_tokens, **options)
    except TypeError as bad:  # an unknown keyword: a caller error, said clearly
        raise InvalidRequest("options", sorted(options), str(bad)) from None
    return batcher.generate_streaming(ids, params, tokenizer.stop_tokens, on_chunk)
