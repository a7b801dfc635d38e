"""`loggable`: a client's text as it may appear in a log line.

A path, a method or a header value comes from the client, and uvicorn hands the path over percent-decoded,
so `/v1/x%0aFAKE` arrives holding a newline. Logged as it is, it would forge a second log line (or move a
terminal's cursor with an escape sequence). Every client string a log line carries goes through
`loggable`: control characters (C0, DEL, C1, and the Unicode line and paragraph separators) are escaped as
Python writes them in a repr, everything else is kept as sent, and the result is bounded in length.
"""

from __future__ import annotations

import re

#: Characters of a client's string a log line keeps; longer ones end in "...".
MAX_LOGGED_CHARS = 256

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def loggable(text: str) -> str:
    """`text` with every control character escaped (`\\n`, `\\x1b`, `\\u2028`), at most `MAX_LOGGED_CHARS` long."""
    if len(text) > MAX_LOGGED_CHARS:
        text = text[:MAX_LOGGED_CHARS] + "..."
    return _UNSAFE.sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    return repr(match[0])[1:-1]  # repr's own escapes: \n, \r, \t, \x1b, \x85, \u2028
