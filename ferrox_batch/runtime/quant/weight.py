"""`QuantizedWeight`: a linear layer's or an embedding's weight kept in quantized blocks, and the row
operations a model's loading applies to weights (stacking projections, reordering a head's rows).

A weight is one or more row segments, each in one format (`formats`), stacked along the output rows:
a GGUF file may store a layer's Q and K projections in Q5_0 and its V in Q8_0, and the runtime fuses
the three into one projection. Its blocks are the file's bytes, copied once into the process's memory
(never a view of a mapped file, whose pages the kernel may drop and count as free), so what a weight
takes is `nbytes`. Every operation here moves whole rows, which the formats store independently (a
block never spans two rows), so no weight is ever requantized by them.

`cat_rows`, `split_rows` and `reorder_rows` take dense tensors and quantized weights alike, so a model's
layer builders read the same whatever the checkpoint stores. Stacking a dense part with a quantized one
(a file that stores one projection in f16 and its neighbour quantized) widens the quantized one.

A weight may also stack the experts of a mixture-of-experts layer, `[experts, rows, cols]`: each segment's
blocks are then `[experts, rows, row_bytes]`, one slice per expert. Since every row is stored on its own,
expert `e`'s weight (`w[e]`, `expert(e)`) is a view of its slice of the blocks, never requantized, and the
stacked weight's bytes are exactly its experts' bytes. `cat_rows` stacks such weights along their rows
(expert by expert); reordering or splitting rows is for 2-D weights only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ferrox_batch.runtime.quant.formats import QuantFormat


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows of one format: `data` is `[rows, format.row_bytes(cols)]` bytes, or `[experts, rows,
    format.row_bytes(cols)]` for a stacked weight, contiguous, on the CPU."""

    format: QuantFormat
    data: torch.Tensor

    @property
    def rows(self) -> int:
        """Rows (of each expert, in a stacked weight)."""
        return self.data.shape[-2]


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A `[rows, cols]` weight, or `[experts, rows, cols]` stacked, as quantized row segments (module
    docstring)."""

    segments: tuple[Segment, ...]
    cols: int

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a quantized weight has at least one segment of rows")
        for segment in self.segments:
            data = segment.data
            if data.dtype != torch.uint8 or data.dim() not in (2, 3) or not data.is_contiguous() \
                    or data.device.type != "cpu":
                raise ValueError(f"a quantized segment is a contiguous 2-D uint8 CPU tensor (3-D for stacked "
                                 f"experts); got {data.dtype} {tuple(data.shape)} on {data.device}")
            if data.shape[-1] != segment.format.row_bytes(self.cols):
                raise ValueError(f"{segment.format.name} rows of {self.cols} weights take "
                                 f"{segment.format.row_bytes(self.cols)} bytes; got rows of {data.shape[-1]}")
        stacks = {tuple(s.data.shape[:-2]) for s in self.segments}
        if len(stacks) != 1:
            raise ValueError(f"a quantized weight's segments stack the same experts; got {sorted(stacks)}")

    @classmethod
    def of(cls, fmt: QuantFormat, data: torch.Tensor | np.ndarray, cols: int,
           experts: int | None = None) -> QuantizedWeight:
        """One segment of `fmt` rows; an array (a GGUF reader's view of its file) is copied into memory. With
        `experts`, the blocks are that many experts' rows, stacked (`[experts, rows, cols]`)."""
        if isinstance(data, np.ndarray):
            data = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
        if experts is not None:
            return cls((Segment(fmt, data.reshape(experts, -1, fmt.row_bytes(cols)).contiguous()),), cols)
        rows = data.reshape(-1, fmt.row_bytes(cols)) if data.dim() != 2 else data
        return cls((Segment(fmt, rows.contiguous()),), cols)

    @property
    def shape(self) -> tuple[int, ...]:
        """`(rows, cols)`, or `(experts, rows, cols)` for a stacked weight."""
        return (*self.segments[0].data.shape[:-2], sum(s.rows for s in self.segments), self.cols)

    @property
    def experts(self) -> int | None:
        """How many experts the weight stacks; None for a 2-D weight."""
        data = self.segments[0].data
        return data.shape[0] if data.dim() == 3 else None

    def expert(self, index: int) -> QuantizedWeight:
        """Expert `index`'s `[rows, cols]` weight: views of its slice of each segment's blocks (no copy)."""
        count = self.experts
        if count is None:
            raise ValueError(f"a {self.shape} weight stacks no experts")
        if not -count <= index < count:
            raise IndexError(f"expert {index} of a weight stacking {count}")
        return QuantizedWeight(tuple(Segment(s.format, s.data[index]) for s in self.segments), self.cols)

    def __getitem__(self, index: int) -> QuantizedWeight:
        """`expert(index)`."""
        return self.expert(index)

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    @property
    def format_names(self) -> tuple[str, ...]:
        """Each segment's format, in row order."""
        return tuple(s.format.name for s in self.segments)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight widened, `[rows, cols]` (`[experts, rows, cols]` stacked) in `dtype`: each value as
        llama.cpp's reference formula gives it in float32 (gguf's), then cast."""
        from gguf.quants import GGMLQuantizationType, dequantize

        lead = self.segments[0].data.shape[:-2]
        parts = [torch.from_numpy(np.asarray(dequantize(s.data.numpy(), GGMLQuantizationType(s.format.ggml_type)),
                                             dtype=np.float32).reshape(*lead, s.rows, self.cols))
                 for s in self.segments]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)).to(dtype)

    def map_rows(self, move: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The weight with `move` applied to its rows (a permutation or selection along the first axis, given
        a tensor whose rows are this weight's rows); one segment only, as a reordering within a head is, and
        not stacked experts (`move` would move experts)."""
        if self.experts is not None:
            raise ValueError(f"rows are reordered in a 2-D weight; this one stacks {self.experts} experts")
        if len(self.segments) != 1:
            raise ValueError("rows are reordered within one format; this weight stacks "
                             f"{'+'.join(self.format_names)}")
        (segment,) = self.segments
        return QuantizedWeight((Segment(segment.format, move(segment.data).contiguous()),), self.cols)


#: A weight as the loaders hand it to the layer builders: dense, or kept quantized.
Weight = torch.Tensor | QuantizedWeight


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """The parts stacked along their rows (all have the same columns; stacked experts: the same experts,
    each expert's rows stacked). Quantized parts stay quantized (adjacent segments of one format merge); a
    mix of dense and quantized parts is widened to the dense parts' dtype."""
    if not parts:
        raise ValueError("nothing to stack")
    # Rows are the axis before the columns: the first of a 2-D weight, the second of stacked experts.
    axis = max(len(parts[0].shape) - 2, 0)
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts), dim=axis)  # type: ignore[arg-type]
    dense = [p for p in parts if isinstance(p, torch.Tensor)]
    if dense:
        dtype, device = dense[0].dtype, dense[0].device
        return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize(dtype).to(device) for p in parts],
                         dim=axis)
    cols = {p.cols for p in parts}  # type: ignore[union-attr]
    if len(cols) != 1:
        raise ValueError(f"stacked weights have the same columns; got {sorted(cols)}")
    experts = {p.experts for p in parts}  # type: ignore[union-attr]
    if len(experts) != 1:
        raise ValueError(f"stacked weights stack the same experts; got {sorted(experts, key=str)}")
    merged: list[Segment] = []
    for part in parts:
        for segment in part.segments:  # type: ignore[union-attr]
            if merged and merged[-1].format == segment.format:
                merged[-1] = Segment(segment.format, torch.cat([merged[-1].data, segment.data], dim=-2))
            else:
                merged.append(segment)
    return QuantizedWeight(tuple(merged), cols.pop())


def split_rows(weight: Weight, sizes: Sequence[int]) -> list[Weight]:
    """`weight`'s rows cut into consecutive parts of `sizes` rows (a quantized weight: of one format)."""
    if isinstance(weight, torch.Tensor):
        return list(weight.split(list(sizes)))
    if sum(sizes) != weight.shape[-2]:
        raise ValueError(f"{weight.shape[-2]} rows cannot be split as {list(sizes)}")
    out: list[Weight] = []
    start = 0
    for size in sizes:
        out.append(weight.map_rows(lambda data, a=start, b=start + size: data[a:b]))
        start += size
    return out


def reorder_rows(weight: Weight, move: Callable[[torch.Tensor], torch.Tensor]) -> Weight:
    """`move` (a reordering along the first axis) applied to a dense weight or to a quantized one's rows."""
    return move(weight) if isinstance(weight, torch.Tensor) else weight.map_rows(move)
