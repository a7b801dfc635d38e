"""How a request asks its conversation to be rendered by the chat template: vLLM's `add_generation_prompt`,
`continue_final_message` and `chat_template_kwargs`, read the same on `/v1/chat/completions` and `/tokenize`.

* `add_generation_prompt` (default true): the template opens the assistant's turn after the messages.
* `continue_final_message` (default false): the text ends where the last message's content ends, so the
  model continues that message (a prefilled assistant answer); not with `add_generation_prompt` (vLLM's
  rule: send `add_generation_prompt: false` with it).
* `chat_template_kwargs`: more variables for the template, such as Qwen3's `enable_thinking`; at most
  `MAX_TEMPLATE_KWARGS_BYTES` as JSON, never a variable the server sets (`messages`, `tools`, ...), and
  never a name the template environment defines (`namespace`, `range`, `loop`, ...), which would shadow it.

And one the server decides, not the request: `escape_control_text` (`--escape-control-tokens`), control-token
text in messages' content read as text (`runtime.loading.control_text`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.runtime.loading.chat_template import SERVER_VARIABLES, TEMPLATE_GLOBALS
from ferrox_batch.server.fields import Fields

#: The most bytes `chat_template_kwargs` may take as compact JSON: flags and a few strings, not documents.
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class ChatRendering:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # (name, JSON value), sorted by name
    escape_control_text: bool = False

    def keywords(self) -> dict[str, Any]:
        """`Tokenizer.apply_chat_template`'s keywords for this rendering."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "template_kwargs": dict(self.template_kwargs), "escape_control_text": self.escape_control_text}


def read_rendering(fields: Fields, *, escape_control_text: bool = False) -> ChatRendering:
    """The request's rendering; `escape_control_text` is the server's."""
    add = fields.boolean("add_generation_prompt", True)
    cont = fields.boolean("continue_final_message", False)
    if add and cont:
        raise InvalidRequest("continue_final_message", True, "cannot be combined with add_generation_prompt: true "
                                                             "(send add_generation_prompt: false)")
    value = fields.raw("chat_template_kwargs")
    if value is None:
        return ChatRendering(add, cont, escape_control_text=escape_control_text)
    if not isinstance(value, dict):
        raise InvalidRequest("chat_template_kwargs", value, "must be an object of template variables")
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequest("chat_template_kwargs", f"{size} bytes",
                             f"must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
    bad = next((k for k in value if not k.isidentifier()), None)
    if bad is not None:
        raise InvalidRequest("chat_template_kwargs", bad, "names must be template variable names")
    for name in value:
        if name in SERVER_VARIABLES:
            raise InvalidRequest("chat_template_kwargs", name, f"cannot set {name!r}: the server sets it")
        if name in TEMPLATE_GLOBALS:
            raise InvalidRequest("chat_template_kwargs", name,
                                 f"cannot set {name!r}: the chat template's environment defines it")
    return ChatRendering(add, cont, tuple(sorted(value.items())), escape_control_text)
