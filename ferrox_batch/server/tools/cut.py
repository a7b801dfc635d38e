"""A forced tool call's answer that ended before its grammar did, read as the calls it began.

With `tool_choice` `required` or a named function, a grammar makes the whole answer calls in the format's
envelope (`<tool_call>` blocks, or the generic `{"tool_calls": [...]}` object), so an answer cut short (by
`max_tokens`, or a stop string) is a prefix of that envelope. The envelope is the server's, never the
client's content: the answer is its calls as far as they got, as vLLM answers a cut forced call, with the
finish reason that cut it (`length`), in whole answers and streams alike (`stream.ToolStream.finish`).

What a cut answer holds, read with the format's own streaming segmenter (`call_scanner`):

* every call whose name the model finished writing, with its arguments' text as far as it was written
  (`""` when none was yet; the text of an unfinished call is not valid JSON, which the finish reason says);
* a call cut before its name was complete only when one function may be called (a named `tool_choice`,
  or `required` with one tool) and it is the first call, which the grammar forces once the answer has
  begun: its name is then known before it is written. With several functions, such a call is left out,
  since nothing says yet which function it calls: an answer cut that early holds no call (content null);
* with `parallel_tool_calls: false`, the first call only.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrox_batch.server.tools.call_scanner import Arguments, Named
from ferrox_batch.server.tools.definitions import ToolCall, ToolCallParser


def cut_calls(parser: ToolCallParser, text: str, functions: Sequence[str], parallel: bool) -> tuple[ToolCall, ...]:
    """The calls a forced answer's `text` began (module docstring); `functions`: those the choice may call."""
    _content, events = parser.segmenter().feed(text)
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, Named):
            names.setdefault(event.call, event.name)
        elif isinstance(event, Arguments):
            arguments.setdefault(event.call, []).append(event.text)
    if 0 not in names and len(functions) == 1 and text:
        names[0] = functions[0]
    calls = tuple(ToolCall(names[i], "".join(arguments.get(i, ()))) for i in sorted(names))
    return calls if parallel else calls[:1]
