"""`BoundWeight`: what every weight bound to one of the C kernels says about itself.

Each linear kernel binds its weight once, at load (fp16 panels, bf16 panels, quantized segments, packed
quantized segments), and the layers and the layer stack then ask it the same three things: its input
and output widths, and the address the C code reads. Those three live here, once; each subclass sets
`_k`, `_n` and `_address` when it binds, and owns the memory the address points into.
"""

from __future__ import annotations


class BoundWeight:
    """A weight of `in_features` inputs and `out_features` outputs bound to a C kernel at `address`."""

    __slots__ = ("_address", "_k", "_n")

    @property
    def in_features(self) -> int:
        return self._k

    @property
    def out_features(self) -> int:
        return self._n

    @property
    def address(self) -> int:
        """What the C kernel reads for this weight (valid as long as the bound object lives)."""
        return self._address
