"""Ollama's generation and embedding requests, said as the chat, completion or embedding body they amount to.

As the Responses API's translation does (`responses_api`), each request is rewritten into the body of the
endpoint that does the same work, which that endpoint's parser then checks like any other, so both APIs
accept and refuse alike:

* `/api/chat`: `messages` (text, an assistant's `tool_calls` with their arguments as an object, `tool`
  answers), `tools`, `format`, `options`, `think` -> a chat body.
* `/api/generate`: `system` and `prompt` -> a chat body of a system and a user message (the model's chat
  template renders them, as Ollama's template does); with `raw: true` the prompt goes untemplated to the
  completion parser. Refused (400 naming the field): a `template` (this server renders the checkpoint's
  Jinja template, not Ollama's Go templates), a `suffix` (no insertion), `context` (the deprecated token
  history: send the conversation to `/api/chat`), `images` (text only), `system` or `think` with `raw`.
* `/api/embed` and `/api/embeddings` -> an embedding body (`embedding_requests`).

A request with nothing to generate is a load request, answered at once (`loading`). Model names carry
Ollama's tags (`names`); `options` are mapped by `options`. `logprobs` and `top_logprobs` are chat's fields
of those names (a raw prompt's `logprobs` count). `think`: `true` needs a reasoning parser (or the harmony
format), `false` asks the template not to think (`enable_thinking: false`), and a level (`low`, `medium`,
`high`) is the harmony format's reasoning effort.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.logprobs import MAX_TOP_LOGPROBS
from ferrox_batch.server.fields import is_int
from ferrox_batch.server.ollama.embedding_requests import embedding_body
from ferrox_batch.server.ollama.loading import check_keep_alive, loaded
from ferrox_batch.server.ollama.names import served_name
from ferrox_batch.server.ollama.options import options_fields
from ferrox_batch.server.unhonoured import CHAT, COMPLETIONS

#: This package's endpoints, as `Preparer.prepare` and `Preparer.wire_format` name them.
OLLAMA_CHAT = "ollama_chat"
OLLAMA_GENERATE = "ollama_generate"
OLLAMA_EMBED = "ollama_embed"
OLLAMA_EMBEDDINGS = "ollama_embeddings"
OLLAMA_ENDPOINTS = (OLLAMA_CHAT, OLLAMA_GENERATE, OLLAMA_EMBED, OLLAMA_EMBEDDINGS)
#: The embeddings endpoint's name in `preparation` (not imported: it imports this module).
EMBEDDINGS = "embeddings"
#: `think`'s levels: the harmony format's reasoning effort.
THINK_LEVELS = ("low", "medium", "high")
#: Image generation's fields (Ollama's experimental image models): refused.
IMAGE_FIELDS = ("width", "height", "steps")


@dataclass(frozen=True, slots=True)
class Served:
    """What a translation needs to know of the server."""

    names: tuple[str, ...]
    #: The longest prompt + output a request may have (None: no ceiling).
    context_length: int | None
    #: Tokens generated when `options.num_predict` is absent (the server's chat default).
    default_max_tokens: int
    #: Whether answers' thinking is read apart (a reasoning parser, or the harmony format).
    thinks: bool = False
    #: Whether the model writes the harmony format (its reasoning effort is a template variable).
    harmony: bool = False


@dataclass(frozen=True, slots=True)
class Translated:
    """A request as the body `kind`'s parser reads (`CHAT`, `COMPLETIONS` or `EMBEDDINGS`)."""

    kind: str
    body: dict[str, Any]


def translate(endpoint: str, body: dict[str, Any], served: Served) -> Translated:
    """The body `endpoint`'s request amounts to; `AnsweredAtOnce` for a load request, a 400 naming the field
    for what cannot be said, Ollama's 404 for a model this server does not serve."""
    asked = body.get("model")
    if asked is None or asked == "":
        raise InvalidRequest("model", asked, "is required")
    if not isinstance(asked, str):
        raise InvalidRequest("model", asked, "must be a string")
    name = served_name(asked, served.names)
    if endpoint in (OLLAMA_EMBED, OLLAMA_EMBEDDINGS):
        return Translated(EMBEDDINGS, embedding_body(body, name, served.context_length,
                                                     older=endpoint == OLLAMA_EMBEDDINGS))
    for field in IMAGE_FIELDS:
        if body.get(field) is not None:
            raise InvalidRequest(field, body[field], "is not supported by this server: it generates text only")
    if endpoint == OLLAMA_CHAT:
        return Translated(CHAT, _chat(body, name, served))
    return _generate(body, name, served)


# ---------------------------------------------------------------------------- generation


def _chat(body: dict[str, Any], name: str, served: Served) -> dict[str, Any]:
    messages = body.get("messages")
    if messages is None or messages == []:
        raise loaded(body, {"message": {"role": "assistant", "content": ""}})
    if not isinstance(messages, list):
        raise InvalidRequest("messages", messages, "must be a list of messages")
    chat = _generating(body, name, served)
    chat["messages"] = _answered_calls([_message(i, m) for i, m in enumerate(messages)], messages)
    tools = body.get("tools")
    if tools is not None and tools != []:
        chat["tools"] = tools  # OpenAI's shape: the chat parser checks them
    _think(body, chat, served)
    return chat


def _generate(body: dict[str, Any], name: str, served: Served) -> Translated:
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidRequest("prompt", prompt, "must be a string")
    for field, what in (("suffix", "insertion (fill-in-the-middle)"),
                        ("template", "Ollama's prompt templates: the model's own chat template renders "
                                     "the prompt (or send raw: true)")):
        value = body.get(field)
        if value is not None and value != "":
            raise InvalidRequest(field, value, f"is not supported by this server ({what})")
    context = body.get("context")
    if context is not None and context != []:
        raise InvalidRequest("context", "...", "is not supported by this server (the deprecated token history): "
                                               "send the conversation to /api/chat as messages")
    _no_images("images", body.get("images"))
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise InvalidRequest("raw", raw, "must be true or false")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise InvalidRequest("system", system, "must be a string")
    if not prompt:
        raise loaded(body, {"response": ""})
    request = _generating(body, name, served)
    if raw:
        for field in ("system", "think"):
            if body.get(field) not in (None, "", False):
                raise InvalidRequest(field, body[field], "cannot be combined with raw: true (the prompt is sent "
                                                         "as it is, untemplated)")
        request["prompt"] = prompt
        top = request.pop("top_logprobs", None)
        if request.pop("logprobs", False):  # a completion's `logprobs` is how many alternatives
            if top is not None and not (is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
                raise InvalidRequest("top_logprobs", top, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
            request["logprobs"] = top or 0
        elif top:
            raise InvalidRequest("top_logprobs", top, "needs logprobs: true")
        return Translated(COMPLETIONS, request)
    request["messages"] = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": prompt}]
    _think(body, request, served)
    return Translated(CHAT, request)


def _generating(body: dict[str, Any], name: str, served: Served) -> dict[str, Any]:
    """The fields a chat and a completion share: the model, `stream`, `options`, `format`, `keep_alive`."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("stream", stream, "must be true or false")
    check_keep_alive(body.get("keep_alive"))
    request: dict[str, Any] = {"model": name, "stream": True if stream is None else stream,
                               **options_fields(body.get("options"), context_length=served.context_length)}
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest("logprobs", logprobs, "must be true or false")
    if logprobs or top is not None:  # chat's fields; a raw prompt's are set from them (`_generate`)
        request["logprobs"], request["top_logprobs"] = bool(logprobs), top
    request.setdefault("max_tokens", served.default_max_tokens)  # a raw prompt's too: the completions' 16 is short
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return request
    if fmt == "json":
        request["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    else:
        raise InvalidRequest("format", fmt, 'must be "json" or a JSON schema (an object)')
    return request


def _think(body: dict[str, Any], request: dict[str, Any], served: Served) -> None:
    think = body.get("think")
    if think is None:
        return
    if think is True:
        if not served.thinks:
            raise InvalidRequest("think", think, "is not supported by this server: it reads no thinking from this "
                                                 "model's answers (it runs without --reasoning-parser)")
    elif think is False:
        if not served.harmony:  # a harmony model always thinks; a template that ignores the variable is unchanged
            request["chat_template_kwargs"] = {"enable_thinking": False}
    elif think in THINK_LEVELS:
        if not served.harmony:
            raise InvalidRequest("think", think, "levels are only for a model that writes the harmony format "
                                                 "(gpt-oss); send true or false")
        request["chat_template_kwargs"] = {"reasoning_effort": think}
    else:
        raise InvalidRequest("think", think, f"must be true, false or one of {', '.join(THINK_LEVELS)}")


def _message(index: int, message: Any) -> dict[str, Any]:
    """One Ollama message as a chat message; its role and content are the chat parser's to check."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequest(where, message, "must be an object with a role and a content")
    _no_images(f"{where}.images", message.get("images"))
    content = message.get("content")
    out: dict[str, Any] = {"role": message.get("role"), "content": "" if content is None else content}
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        if not isinstance(calls, list):
            raise InvalidRequest(f"{where}.tool_calls", calls, "must be a list of function calls")
        out["tool_calls"] = [_call(f"{where}.tool_calls[{j}]", index, j, call) for j, call in enumerate(calls)]
    # An earlier answer's `thinking`: chat templates drop it from the history, as Ollama's do.
    return out


def _answered_calls(said: list[dict[str, Any]], sent: list[Any]) -> list[dict[str, Any]]:
    """`said` with each tool answer's `tool_call_id`: the earliest call still unanswered of the function its
    `tool_name` names (any, without a name). Ollama's messages name the function, not the call; templates
    that pair an answer with its call read the id."""
    waiting: list[tuple[str, str]] = []  # (call id, function name), in the order the calls were made
    for message, original in zip(said, sent):
        if message.get("tool_calls"):
            waiting = [(call["id"], call["function"]["name"]) for call in message["tool_calls"]]
        elif message.get("role") == "tool" and waiting:
            named = original.get("tool_name")
            match = next((i for i, (_, fn) in enumerate(waiting) if named is None or fn == named), None)
            if match is not None:
                message["tool_call_id"] = waiting.pop(match)[0]
    return said


def _call(where: str, index: int, position: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest(where, call, 'must be {"function": {"name": ..., "arguments": {...}}}')
    arguments = function.get("arguments", {})
    if not isinstance(arguments, (dict, str)):
        raise InvalidRequest(f"{where}.function.arguments", arguments, "must be an object")
    return {"id": f"call_{index}_{position}", "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def _no_images(where: str, images: Any) -> None:
    if images is not None and images != []:
        raise InvalidRequest(where, "...", "is not supported by this server: it serves a text-only model")

