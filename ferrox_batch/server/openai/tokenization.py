"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes: what the server would feed the model, and back.

Clients use them to count tokens before sending (budgets, truncation) and to read ids back as text. They
promise the ids the generation endpoints would submit: `/tokenize` with `messages` and its defaults gives
exactly the ids `/v1/chat/completions` queues for those messages, and with `prompt` exactly those of
`/v1/completions` (with `tools`, as chat renders them). `max_model_len` is the longest prompt + output a
request may hold here (the context ceiling), which is what a client sizes against. Bad input is a 400
naming the field, as everywhere. A text longer than the ceiling is counted all the same (a client counting
a text it means to truncate needs the count): the body size cap bounds the work, tokenizing releases the
GIL, and the endpoints' own open-request cap bounds how many run at once. What an answer holds is bounded
too (`request_caps`): `/tokenize` lists at most `max_tokenization_ids` ids (a text that must tokenize to
more is refused untokenized), and `/detokenize` takes at most that many and writes at most
`max_detokenize_bytes` of text, known from the ids' own byte lengths before the text is built. A
`/detokenize` body is refused unparsed when its size alone shows it is not a list the cap takes
(`detokenize_body_limit`): parsing a list of ids is one call that holds the interpreter (about 70 ms for
4 MiB), during which no other request's work runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.errors import DecodeError, InvalidRequest
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.server.http.errors import ServerBusy
from ferrox_batch.server.fields import Fields
from ferrox_batch.server.prompt_ids import encode_chat_prompt
from ferrox_batch.server.request_caps import RequestCaps, check_text_bytes, check_token_count
from ferrox_batch.server.chat_messages import read_messages
from ferrox_batch.server.chat_rendering import read_rendering
from ferrox_batch.server.tools.definitions import read_tools
from ferrox_batch.server.tools.generic import describe_tools


class TokenizationsBusy(ServerBusy):
    """More `/tokenize` and `/detokenize` requests open than the server takes: busy, not wrong (503, retry)."""

    def __init__(self, open: int, limit: int, kind: str = "tokenization requests") -> None:
        self.open = open
        self.limit = limit
        DecodeError.__init__(self, f"server is at capacity: {open} {kind} are already open "
                                   f"(limit {limit}); retry shortly")


#: A `/tokenize` or `/detokenize` body past this many bytes is a large one, and only
#: `MAX_LARGE_TOKENIZATIONS` of those are open at once (more are busy: 503). A tokenization runs on one core
#: (the tokenizer's batch call of one text), so with one at a time the worker keeps the other core of a
#: two-core machine; a 64 KiB text tokenizes in tens of milliseconds, well under one request's own work.
LARGE_TOKENIZATION_BYTES = 64 * 1024
MAX_LARGE_TOKENIZATIONS = 1


#: Bytes a `/detokenize` body may hold beyond its ids written as JSON writes them: its other fields, braces
#: and some whitespace.
DETOKENIZE_BODY_SLACK = 4096


def detokenize_body_limit(tokenizer: Tokenizer, caps: RequestCaps) -> int:
    """The most bytes a `/detokenize` body may hold: `caps.max_tokenization_ids` ids, each written with the
    digits of the largest id and JSON's `", "`, and `DETOKENIZE_BODY_SLACK`. A longer body holds more ids
    than the cap or pads them past what a JSON writer does; either way it is refused before it is parsed."""
    digits = len(str(max(tokenizer.decodable_ids - 1, 0)))
    return caps.max_tokenization_ids * (digits + len(", ")) + DETOKENIZE_BODY_SLACK


def check_detokenize_body(size: int, tokenizer: Tokenizer, caps: RequestCaps) -> None:
    """A 400 naming `tokens` and the cap when a body of `size` bytes is past `detokenize_body_limit`."""
    limit = detokenize_body_limit(tokenizer, caps)
    if size > limit:
        raise InvalidRequest("tokens", f"<a body of {size:,} bytes>",
                             f"must be at most {caps.max_tokenization_ids:,} ids (--max-tokenization-ids): a body "
                             f"of more than {limit:,} bytes holds more, or pads them")


def tokenize(body: Mapping[str, Any], tokenizer: Tokenizer, ceiling: ContextCeiling,
             caps: RequestCaps = RequestCaps(), *, escape_control_tokens: bool = False) -> dict[str, Any]:
    """`{"prompt": text}` or `{"messages": [...]}` -> `{"count", "max_model_len", "tokens", "token_strs"}`;
    messages as the chat endpoint renders them (`escape_control_tokens`: the server's setting)."""
    fields = Fields(body)
    return_strs = fields.boolean("return_token_strs", False)
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("prompt", body.get("prompt"), "send exactly one of prompt and messages")
    if "messages" in body:
        rendering = read_rendering(fields, escape_control_text=escape_control_tokens)
        messages = read_messages(body["messages"])
        tools = read_tools(body.get("tools"))
        if tools and not tokenizer.supports_tools:  # described in a system message, as chat does
            messages, tools = tuple(describe_tools(messages, tools)), ()
        # The template writes any BOS itself, as for the chat endpoint.
        ids = encode_chat_prompt(tokenizer, messages, None, tools=list(tools) or None, rendering=rendering,
                                 add_special_tokens=fields.boolean("add_special_tokens", False))
        check_token_count(caps, len(ids), "messages")
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt", prompt, "must be a string")
        check_token_count(caps, tokenizer.least_tokens(prompt), "prompt")  # refused untokenized when it must be
        # Counted before the ids are built: a text past the cap is refused without its list of ids.
        count, maybe = tokenizer.encode_within(prompt, caps.max_tokenization_ids,
                                               add_special_tokens=fields.boolean("add_special_tokens", True))
        check_token_count(caps, count, "prompt")
        assert maybe is not None
        ids = maybe
    strs = [tokenizer.decode_text([i]) for i in ids] if return_strs else None
    return {"count": len(ids), "max_model_len": ceiling.limit(), "tokens": ids, "token_strs": strs}


def detokenize(body: Mapping[str, Any], tokenizer: Tokenizer, caps: RequestCaps = RequestCaps()) -> dict[str, Any]:
    """`{"tokens": [ids]}` -> `{"prompt": text}`; an id outside the vocabulary is a 400, and so are more ids,
    or more text, than the caps take."""
    tokens = body.get("tokens")
    if isinstance(tokens, list):
        check_token_count(caps, len(tokens), "tokens")  # before any id is read
    # The ids' types gathered by a C loop (`map`), not bytecode: a bool's type is not `int`.
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= {int}:
        raise InvalidRequest("tokens", tokens, "must be a list of token ids")
    try:
        # Counted only where the longest token could take the text past the cap: the count is a pass over
        # the ids as long as the decoding itself, holding the interpreter as long.
        if len(tokens) * tokenizer.longest_token_bytes > caps.max_detokenize_bytes:
            check_text_bytes(caps, tokenizer.decoded_size(tokens))
        return {"prompt": tokenizer.decode_text(tokens)}
    except ValueError as bad:
        if isinstance(bad, InvalidRequest):
            raise
        raise InvalidRequest("tokens", tokens, str(bad)) from None
