"""Control-token text typed into a message, spelt so that the tokenizer reads it as text.

A tokenizer matches its added tokens (`<|im_start|>`, `<|eot_id|>`, `<think>`) in the raw text before
anything else, so a message whose content spells one gets that token's id: a user, a retrieved document or
a tool's output could close its turn and open a system one. `ControlText.escape` puts a WORD JOINER (U+2060:
invisible, no width) after the first character of every such spelling. The text reads the same, the
added-token matcher no longer sees the token, and the model gets its characters as ordinary pieces.

Which texts (`control_texts`): every added token of two characters or more that is special, or that has a
character other than letters, digits and whitespace (markup such as `<think>`); an added token that is a
plain word or a run of spaces is text anyway. A one-character control token cannot be spelt apart and is
left as it is.

The texts are matched by one regular expression shaped as a trie of them, so a scan costs time linear in
the content whatever it holds (a plain alternation of a few hundred tokens takes seconds per MiB of a
hostile `<|<|<|...`). Escaping one spelling can leave another spelt across the cut when two texts overlap
(`<|a` and `a>` in `<|a>`); the scan repeats until none is left.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

#: What goes after a control text's first character: U+2060 WORD JOINER, invisible and of no width.
ESCAPE = "\u2060"


def control_texts(added: Iterable[tuple[str, bool]]) -> tuple[str, ...]:
    """The texts to escape among a tokenizer's added tokens, given as (text, special) (module docstring)."""
    return tuple(text for text, special in added
                 if len(text) >= 2 and ESCAPE not in text
                 and (special or any(not (ch.isalnum() or ch.isspace()) for ch in text)))


def _trie_pattern(texts: Iterable[str]) -> str:
    """A regular expression matching exactly `texts`, the longest at a position first, shaped as their trie."""
    trie: dict = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}  # a text ends here

    def alternatives(node: dict) -> str:
        branches = [re.escape(ch) + alternatives(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return alternatives(trie)


class ControlText:
    """The control texts of one tokenizer, and their escape (module docstring)."""

    __slots__ = ("texts", "_pattern")

    def __init__(self, texts: tuple[str, ...]) -> None:
        self.texts = texts
        self._pattern = re.compile(_trie_pattern(texts)) if texts else None

    def escape(self, text: str) -> str:
        """`text` with a WORD JOINER after the first character of each control text it spells."""
        if self._pattern is None:
            return text
        while True:
            text, found = self._pattern.subn(lambda m: m[0][0] + ESCAPE + m[0][1:], text)
            if not found:
                return text

    def escape_within(self, value: Any) -> Any:
        """`value` (JSON: a tool definition) with every string in it, keys included, escaped."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self.escape_within(k): self.escape_within(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape_within(v) for v in value]
        return value
