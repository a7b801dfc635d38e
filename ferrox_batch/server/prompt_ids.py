"""Prompt text to ids, refusing unread a text too long to ever fit the context.

Tokenizing is the costliest step of a request before admission, and it grows with the prompt:
a body near the size cap takes seconds. But a text's length alone bounds its id count from below
(`Tokenizer.least_tokens`: no id stands for more than `max_token_chars` characters), so a text
whose bound is past the context ceiling can never be served, and is refused before the tokenizer
sees it, with the ceiling's own refusal (`KvBudgetExceeded`, `context_length_exceeded`, 400), the
one a prompt that tokenized too long gets. A text that passes may still be refused once its exact
count is known. `/tokenize` passes no ceiling: it counts, and a client counting a text it means to
truncate must get the count, not a refusal. These refusals are not the ceiling's: they leave its counter alone (the server's
refusal metrics count them by their code).

A tokenizer that gives no such bound (one that may drop or merge unbounded input) still need not read a
4 MiB text to refuse it: a prefix is tokenized first, growing geometrically (`prefix_refusal`), and a
prefix of more than twice the ceiling's ids refuses the text. A prefix's ids differ from the whole text's
only near the cut (where a piece the cut split is tokenized apart), so asking for twice the ceiling leaves
the refusal sure while the cut may change up to half of them; the prefixes cost at most a third more than
tokenizing the text once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequest, KvBudgetExceeded
from ferrox_batch.runtime.loading.chat_template import ChatMessage
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.chat_rendering import ChatRendering


def encode_prompt(tokenizer: Tokenizer, text: str, ceiling: ContextCeiling | None, *,
                  add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text)`, unless `text` is provably longer than the ceiling (`KvBudgetExceeded`);
    None: no ceiling (counting tokens only)."""
    limit = None if ceiling is None else ceiling.limit()
    if ceiling is not None and limit is not None:
        least = tokenizer.least_tokens(text)
        detail = f"its {len(text)} characters are at least {least} tokens"
        if least <= limit and tokenizer.max_token_chars is None:
            least, detail = prefix_refusal(tokenizer, text, limit)
        if least > limit:
            raise KvBudgetExceeded(
                binding=CONTEXT_LENGTH_EXCEEDED, estimated_bytes=ceiling.bytes_for(least),
                limit_bytes=ceiling.bytes_for(limit), positions=least, positions_limit=limit,
                detail=f"prompt is too long: {detail} > {limit} maximum")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


#: Characters per position of the ceiling in the first prefix `prefix_refusal` tokenizes (several times a
#: typical text's characters per token, so one prefix usually settles a text far past the context), and
#: how much each next prefix grows.
PREFIX_CHARS_PER_POSITION = 8
PREFIX_GROWTH = 4


def prefix_refusal(tokenizer: Tokenizer, text: str, limit: int) -> tuple[int, str]:
    """A lower bound on `text`'s ids (past `limit` when a prefix proves it; 0 when none does) and its reason.

    Prefixes of `PREFIX_CHARS_PER_POSITION * (limit + 1)` characters, then `PREFIX_GROWTH` times as many, are
    tokenized while shorter than the text; one of more than `2 * limit` ids proves the text has more than
    `limit` (half of its ids may differ from the whole text's near the cut, module docstring)."""
    chars = PREFIX_CHARS_PER_POSITION * (limit + 1)
    while chars < len(text):
        count = tokenizer.encode_within(text[:chars], 2 * limit, add_special_tokens=False)[0]
        if count > 2 * limit:
            return count // 2, f"its first {chars} characters are {count} tokens, half of which is"
        chars *= PREFIX_GROWTH
    return 0, ""


def encode_chat_prompt(tokenizer: Tokenizer, messages: Sequence[ChatMessage | Mapping[str, Any]],
                       ceiling: ContextCeiling | None, *, tools: Sequence[Mapping[str, Any]] | None = None,
                       rendering: ChatRendering = ChatRendering(), add_special_tokens: bool = False) -> list[int]:
    """The templated conversation's ids (`Tokenizer.encode_chat`, checked as `encode_prompt`), rendered as
    `rendering` asks; a template that refuses the messages is the client's 400."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, **rendering.keywords())
    except ValueError as bad:
        raise InvalidRequest("messages", list(messages),
                             f"could not be rendered by the checkpoint's chat template ({bad})") from None
    # The template writes any BOS itself.
    return encode_prompt(tokenizer, text, ceiling, add_special_tokens=add_special_tokens)
