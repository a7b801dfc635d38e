"""How many stop strings and stop token ids one request may ask for, and how long a stop string may be.

Each stop string is matched on every decoded token of its row, on the worker
thread that serves the whole batch, and the matcher is built from the list
when the request is admitted. The matcher's per-token cost does not depend on
the list (`policy.stop_automaton`), but its memory and its build time grow
with the total length of the stops, so both are bounded here, and checked on
the caller's thread with the rest of `GenerationParams`, before the request
is queued.

The limits are far above what clients send: OpenAI allows 4 stop strings;
evaluation harnesses send a handful (lm-eval's `until`: the end-of-text
marker and a few task delimiters); vLLM and llama.cpp's server do not cap.
Shared vocabulary (no torch, no scheduler), so any layer can quote them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrox_batch.errors import InvalidRequest

__all__ = ["MAX_STOPS", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "check_stop_limits"]

#: Stop strings per request: 16x OpenAI's 4. With `MAX_STOP_CHARS` it bounds
#: the matcher to 16,384 trie nodes (about 5 MB, built in about 20 ms once per
#: request in the worst case of stops sharing no prefix).
MAX_STOPS = 64

#: Characters (code points) per stop string. Stops are markers -- "</s>",
#: "\nQuestion:", "<|im_end|>" -- tens of characters at most; 256 is a
#: paragraph. It also bounds how much text the matcher ever withholds.
MAX_STOP_CHARS = 256

#: Stop token ids per request, counting the stop strings that are one token
#: (`engine.text.text_params` adds those, up to `MAX_STOPS`), so a caller's own
#: list may hold at least 192. Each is one frozenset entry, checked per token
#: in constant time; the cap bounds the set built per request.
MAX_STOP_TOKEN_IDS = 256


def check_stop_limits(stop: Sequence[str], stop_token_ids: Sequence[int]) -> None:
    """Raise `InvalidRequest` naming `stop` or `stop_token_ids` when a list is
    longer than its limit or a stop string is longer than `MAX_STOP_CHARS`.
    The entries' types are the caller's to have checked."""
    if len(stop) > MAX_STOPS:
        raise InvalidRequest("stop", len(stop), f"may hold at most {MAX_STOPS} strings")
    for s in stop:
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                "stop", s, f"entries must be at most {MAX_STOP_CHARS} characters (one has {len(s)})"
            )
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            "stop_token_ids", len(stop_token_ids),
            f"may hold at most {MAX_STOP_TOKEN_IDS} ids (counting stop strings that are one token)",
        )
