"""`ChatTemplate`: a checkpoint's Jinja chat template, compiled in a sandbox and rendered from a conversation.

It promises: a template that does not compile is a `ModelLoadError` when it is set, never at a request;
templates run in Jinja's immutable sandbox with the helpers Hugging Face templates call (`raise_exception`,
`tojson`); a request's own template variables never shadow what the server hands every template
(`SERVER_VARIABLES`) nor a name the template environment defines (`TEMPLATE_GLOBALS`); every failure to
render is a `ValueError` naming what went wrong, which the server answers with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox

from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.loading.control_text import ControlText

#: The variables the server hands every chat template itself.
SERVER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
#: Names a chat template's environment gives a meaning: Jinja's globals (`range`, `dict`, `namespace`,
#: `cycler`, `joiner`, `lipsum`), the helpers templates call (`raise_exception`, and transformers'
#: `strftime_now`, which templates test for), and the names Jinja itself binds inside a template (`loop`,
#: `self`, `super`, `caller`, `varargs`, `kwargs`). A request's variable of such a name would shadow it, and
#: the template would call or index a string.
TEMPLATE_GLOBALS = frozenset(jinja2.defaults.DEFAULT_NAMESPACE) | {
    "raise_exception", "strftime_now", "loop", "self", "super", "caller", "varargs", "kwargs"}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    #: An assistant turn's tool calls, in OpenAI's shape (`{"id", "type": "function", "function": {"name",
    #: "arguments"}}`), handed to the chat template as they are.
    tool_calls: tuple[dict[str, Any], ...] | None = None
    #: A `tool` turn's answer to which call.
    tool_call_id: str | None = None


class ChatTemplate:
    """One compiled chat template (immutable once built)."""

    __slots__ = ("source", "supports_tools", "_template")

    def __init__(self, source: str) -> None:
        """`ModelLoadError` unless `source` (Jinja text) compiles."""
        self._template = compile_template(source)
        self.source = source
        #: Whether the template reads `tools` (renders the tool definitions a request offers).
        self.supports_tools = "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))

    def render(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        bos_token: str,
        eos_token: str,
        control_text: ControlText,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        escape_control_text: bool = False,
    ) -> str:
        """The conversation as the template writes it (`Tokenizer.apply_chat_template` says what each
        argument asks for); `control_text`: how control-token text is escaped where it is."""
        if not messages:
            raise ValueError("a chat needs at least one message")
        if tools and not self.supports_tools:
            raise ValueError("this checkpoint's chat template does not render tools")
        rendered = []
        for i, m in enumerate(messages):
            message = m if isinstance(m, ChatMessage) else ChatMessage(m.get("role"), m.get("content"),  # type: ignore[arg-type]
                                                                    m.get("tool_calls"), m.get("tool_call_id"))
            if not isinstance(message.role, str) or not isinstance(message.content, str):
                raise ValueError(f"message {i} needs a string role and a string content")
            content = message.content
            if escape_control_text and message.role != "assistant":
                content = control_text.escape(content)
            one: dict[str, Any] = {"role": message.role, "content": content}
            if message.tool_calls:
                one["tool_calls"] = [dict(call) for call in message.tool_calls]
            if message.tool_call_id is not None:
                one["tool_call_id"] = message.tool_call_id
            rendered.append(one)
        if tools and escape_control_text:
            tools = [control_text.escape_within(dict(t)) for t in tools]
        core = {"messages": rendered, "add_generation_prompt": add_generation_prompt,
                "bos_token": bos_token, "eos_token": eos_token,
                **({"tools": [dict(t) for t in tools]} if tools else {})}
        clash = sorted(set(template_kwargs or {}) & (SERVER_VARIABLES | TEMPLATE_GLOBALS))
        if clash:
            raise ValueError(f"template variables {clash} are set by the server or its template environment, "
                             "not by the request")
        try:
            text = self._template.render(**{**(template_kwargs or {}), **core})
        # A field the template needs and the messages lack (TemplateError), or a value it cannot use: a
        # request's variable of the wrong type (TypeError, as vLLM also answers with a 400).
        except (jinja2.TemplateError, TypeError) as bad:
            raise ValueError(f"chat template failed on the messages: {bad}") from None
        if continue_final_message:
            final = rendered[-1]["content"]
            for cut in (final, final.strip()):
                at = text.rfind(cut) if cut else -1
                if at >= 0:
                    return text[:at + len(cut)]
            raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
        return text


def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the sandbox, with the helpers templates call; `ModelLoadError` unless it compiles."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template refused the messages: {message}")

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as bad:
        raise ModelLoadError(f"chat template does not compile: {bad}") from None


def template_text(value: Any) -> str | None:
    """A `tokenizer_config.json`'s `chat_template`: its text, or of a list of named ones the "default"."""
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return entry.get("template")
        return None
    return value if isinstance(value, str) else None
