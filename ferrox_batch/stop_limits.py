"""How many stop strings and stop token ids one request may ask for, how long a stop string may be, and how
many characters its stop strings may hold in all.

Each stop string is matched on every decoded token of its row, on the worker
thread that serves the whole batch, and the matcher is built from the list
when the request is admitted. The matcher's per-token cost does not depend on
the list (`policy.stop_automaton`), but its memory and its build time grow
with the total length of the stops, so both are bounded here, and checked on
the caller's thread with the rest of `GenerationParams`, before the request
is queued. The total is one check (`check_stop_chars`) for every caller: a
library caller is held to `DEFAULT_MAX_STOP_CHARS` unless its params say
otherwise, and the server's `--max-stop-chars` calls it with its own value.

The limits are far above what clients send: OpenAI allows 4 stop strings;
evaluation harnesses send a handful (lm-eval's `until`: the end-of-text
marker and a few task delimiters); vLLM and llama.cpp's server do not cap.
Shared vocabulary (no torch, no scheduler), so any layer can quote them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrox_batch.errors import InvalidRequest

__all__ = ["DEFAULT_MAX_STOP_CHARS", "MAX_STOPS", "MAX_STOP_STRING_CHARS", "MAX_STOP_TOKEN_IDS", "check_stop_chars",
           "check_stop_limits"]

#: Stop strings per request: 16x OpenAI's 4.
MAX_STOPS = 64

#: Characters (code points) per stop string. Stops are markers -- "</s>",
#: "\nQuestion:", "<|im_end|>" -- tens of characters at most; 256 is a
#: paragraph. It also bounds how much text the matcher ever withholds.
MAX_STOP_STRING_CHARS = 256

#: Characters over all of a request's stop strings, unless its caller sets another bound (the server's
#: `--max-stop-chars`, whose default this is). A worst-case list of the per-string limits (64 x 256
#: characters sharing no prefix) builds a 5.25 MB matcher in 22 ms (57 ms on a loaded machine); 2,048
#: characters build 0.65 MB in 1.5 ms, and are far above what clients send (OpenAI's 4 stops; evaluation
#: harnesses' few delimiters of tens of characters).
DEFAULT_MAX_STOP_CHARS = 2048

#: Stop token ids per request, counting the stop strings that are one token
#: (`engine.text.text_params` adds those, up to `MAX_STOPS`), so a caller's own
#: list may hold at least 192. Each is one frozenset entry, checked per token
#: in constant time; the cap bounds the set built per request.
MAX_STOP_TOKEN_IDS = 256


def check_stop_chars(stop: Sequence[object], max_chars: int, flag: str | None = None) -> None:
    """Raise `InvalidRequest` naming `stop` when its strings hold more than `max_chars` characters in all
    (entries that are not strings are the type check's to refuse, and count nothing here); `flag`: the
    setting that chose `max_chars`, named in the refusal."""
    total = sum(len(s) for s in stop if isinstance(s, str))
    if total > max_chars:
        where = f"this server's {flag}" if flag is not None else "max_stop_chars"
        raise InvalidRequest("stop", total, f"strings may hold at most {max_chars:,} characters in all ({where})")


def check_stop_limits(stop: Sequence[str], stop_token_ids: Sequence[int],
                      max_chars: int = DEFAULT_MAX_STOP_CHARS) -> None:
    """Raise `InvalidRequest` naming `stop` or `stop_token_ids` when a list is
    longer than its limit, a stop string is longer than `MAX_STOP_STRING_CHARS`,
    or the strings hold more than `max_chars` characters in all (`check_stop_chars`).
    The entries' types are the caller's to have checked."""
    if len(stop) > MAX_STOPS:
        raise InvalidRequest("stop", len(stop), f"may hold at most {MAX_STOPS} strings")
    for s in stop:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(
                "stop", s, f"entries must be at most {MAX_STOP_STRING_CHARS} characters (one has {len(s)})"
            )
    check_stop_chars(stop, max_chars)
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            "stop_token_ids", len(stop_token_ids),
            f"may hold at most {MAX_STOP_TOKEN_IDS} ids (counting stop strings that are one token)",
        )
