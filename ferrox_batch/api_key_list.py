"""API keys as an operator writes them, for every place that reads them (the CLI, the Ray Serve config).

Shared vocabulary: no torch and no server import, so `ferrox-batch --help` stays quick.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_keys(value: str | Sequence[str]) -> tuple[str, ...]:
    """Keys as an operator writes them: one string of comma-separated keys, or a list of such strings (a
    bearer token cannot hold a comma, RFC 6750, so a comma always separates keys). ValueError for an empty
    key, no key at all, or a key given twice: each is a mistake, never "an open API"."""
    values = [value] if isinstance(value, str) else list(value)
    keys = tuple(key.strip() for item in values for key in str(item).split(","))
    if not keys or not all(keys):
        raise ValueError("is empty: leave it unset for an open API")
    if len(set(keys)) != len(keys):
        raise ValueError("lists a key twice: each key names one tenant")
    return keys
