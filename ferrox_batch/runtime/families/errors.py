"""The errors of reading a checkpoint's description: a config or metadata the runtime cannot honour.

They live with the families because the families are what reads a checkpoint's description, below
everything that builds or runs a model; `runtime.errors` re-exports them beside the runtime's other
load-time errors.
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
