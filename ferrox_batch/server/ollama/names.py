"""Ollama's model names: `name:tag`, where a name without a tag means `name:latest`.

The server serves its model under the names it was started with (`--served-model-name`). An Ollama client
names one with or without `:latest` (Ollama's listing shows every name tagged, so clients send the tag
back): either form matches, any other name or tag is Ollama's 404 (`model 'x' not found`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrox_batch.server.ollama.errors import OllamaModelNotFound

LATEST = ":latest"


def tagged(name: str) -> str:
    """`name` as Ollama lists it: with its tag, `:latest` where it has none."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + LATEST


def served_name(asked: str, names: Sequence[str]) -> str:
    """The served name `asked` means (with or without `:latest`); Ollama's 404 when it means none."""
    for name in names:
        if asked == name or tagged(asked) == tagged(name):
            return name
    raise OllamaModelNotFound(asked)
