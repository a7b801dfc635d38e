"""`--reasoning-parser`: the thinking of models that think between `<think>` and `</think>` (Qwen3, SmolLM3,
DeepSeek-R1 distills), sent apart from the answer, as vLLM does.

A chat answer's thinking goes to `message.reasoning_content` and, streamed, to `delta.reasoning_content`;
the rest is `content`, where tool calls are parsed and structured output applies (its grammar lets the
thinking through first: `StructuredOutput.reasoning`). Two parsers, by where the thinking begins:

* `deepseek_r1`: the answer begins inside the thinking (the template opens it in the prompt), with or
  without a written `<think>`, and the thinking ends at `</think>` (never written: all of it is thinking);
* `qwen3`: the answer thinks only when it begins with `<think>` (after whitespace), until `</think>` or
  its end; otherwise it is all content (thinking switched off, `enable_thinking: false`).

A stream and a whole answer split the same text the same way: `ReasoningSplit` reads it in pieces,
holding back only a tail that could begin a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrox_batch.server.tools.hermes import held_tail

START, END = "<think>", "</think>"
#: `--reasoning-parser`'s names -> whether the answer begins inside the thinking. `openai_gptoss` is the
#: harmony format (gpt-oss), whose thinking is a channel, not a tag: read by `harmony_choice`, not here.
REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False, "openai_gptoss": False}
HARMONY = "openai_gptoss"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.name!r}; use one of {', '.join(REASONING_PARSERS)}")
        if self.name == HARMONY:
            raise ValueError(f"{HARMONY} reads the harmony format: `harmony_choice`, not a ReasoningParser")

    @property
    def implicit(self) -> bool:
        """Whether the answer begins inside the thinking (`StructuredOutput.reasoning`'s value)."""
        return REASONING_PARSERS[self.name]

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(thinking, content) of a whole answer; None where there is none."""
        stream = ReasoningSplit(self.implicit)
        thinking, content = stream.feed(text)
        more_thinking, more_content = stream.finish()
        thinking, content = thinking + more_thinking, content + more_content
        return (thinking if stream.thought and text else None), (content or None)


class ReasoningSplit:
    """One answer's text, split as it comes into thinking and content."""

    def __init__(self, implicit: bool) -> None:
        # "opening": thinking whether or not the tag is written (a written one is dropped); "start": thinking
        # only if the tag opens the answer; then "think" until the end tag, then "content".
        self._mode = "opening" if implicit else "start"
        self._held = ""
        self.thought = implicit  # whether the answer has thinking

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, content) that may go out now."""
        thinking, content = [], []
        text = self._held + text
        self._held = ""
        while text:
            if self._mode == "content":
                content.append(text)
                break
            if self._mode in ("start", "opening"):
                head = text.lstrip()
                if not head or (START.startswith(head) and len(head) < len(START)):
                    self._held = text  # may still open with the tag
                    break
                if head.startswith(START):
                    self._mode, self.thought, text = "think", True, head[len(START):]
                    continue
                self._mode = "think" if self._mode == "opening" else "content"
                continue
            at = text.find(END)
            if at >= 0:
                thinking.append(text[:at])
                self._mode, text = "content", text[at + len(END):]
                continue
            keep = held_tail(text, END)
            thinking.append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(thinking), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the answer is complete: thinking, or content where it never began."""
        held, self._held = self._held, ""
        if self._mode in ("think", "opening"):
            return held, ""
        return "", held
