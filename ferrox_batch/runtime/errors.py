"""Load-time errors of the model runtime.

These are about the checkpoint on disk (missing, corrupt, an architecture we
do not run), not about a request; request-time errors are the `DecodeError`
family in `ferrox_batch.errors`.
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """A checkpoint could not be read: missing file, corrupt data, malformed config."""


class UnsupportedArchitecture(ModelLoadError):
    def __init__(self, architecture: str, supported: list[str]) -> None:
        self.architecture = architecture
        self.supported = list(supported)
        super().__init__(
            f"architecture {architecture!r} is not supported; "
            f"supported: {', '.join(self.supported)}"
        )


class FetchError(Exception):
    """The default checkpoint could not be fetched or converted."""
