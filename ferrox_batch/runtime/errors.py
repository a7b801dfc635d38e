"""Load-time errors of the model runtime.

These are about the checkpoint on disk (missing, corrupt, an architecture we
do not run), not about a request; request-time errors are the `DecodeError`
family in `ferrox_batch.errors`. The two about a checkpoint's description are
the families' (`runtime.families.errors`), re-exported here.
"""

from __future__ import annotations

from ferrox_batch.runtime.families.errors import ModelLoadError, UnsupportedArchitecture

__all__ = ["FetchError", "ModelLoadError", "UnsupportedArchitecture"]


class FetchError(Exception):
    """The default checkpoint could not be fetched or converted."""
