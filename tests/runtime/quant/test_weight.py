"""`QuantizedWeight`'s row operations, quantizing at load, and the `--weights` choice.

Every row operation must be the dense operation on the dequantized weight, exactly: rows are stored
independently, so moving them moves their values bit for bit. Quantizing at load must write the blocks
gguf-py's reference quantizer writes (what a converter would have put in a file).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.runtime.quant.choice import WEIGHTS_CHOICES, choose_weights
from ferrox_batch.runtime.quant.formats import BY_GGML_TYPE, FORMATS
from ferrox_batch.runtime.quant.quantize import LOAD_FORMATS, load_format, quantize
from ferrox_batch.runtime.quant.weight import QuantizedWeight, cat_rows, reorder_rows, split_rows


def weight_in(name: str, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """A random weight in `name`: quantized by gguf where it can, else random blocks with finite scales."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    if name in LOAD_FORMATS:
        values = rng.standard_normal((rows, cols), dtype=np.float32)
        return QuantizedWeight.of(fmt, gguf_quantize(values, GGMLQuantizationType(fmt.ggml_type)), cols)
    blocks = rng.integers(0, 256, size=(rows, cols // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    scale = np.array([0.02], dtype=np.float16).view(np.uint8)
    if name == "mxfp4":
        blocks[:, :, 0] = 122  # its one E8M0 byte: a power-of-two scale, 2^-6
    for offset in {"q4_k": (0, 2), "q6_k": (208,), "mxfp4": ()}[name]:
        blocks[:, :, offset:offset + 2] = scale
    return QuantizedWeight.of(fmt, blocks.reshape(rows, -1), cols)


def test_the_formats_are_gguf_s_block_sizes() -> None:
    from gguf import GGML_QUANT_SIZES

    for fmt in FORMATS.values():
        assert GGML_QUANT_SIZES[GGMLQuantizationType(fmt.ggml_type)] == (fmt.block_elems, fmt.block_bytes)
        assert BY_GGML_TYPE[fmt.ggml_type] is fmt
    assert FORMATS["q8_0"].bits_per_weight == 8.5 and FORMATS["q4_k"].bits_per_weight == 4.5
    with pytest.raises(ValueError, match="whole number"):
        FORMATS["q4_k"].row_bytes(576)


@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_is_gguf_s(name: str) -> None:
    cols = 512
    weight = weight_in(name, 6, cols, 1)
    fmt = weight.segments[0].format
    want = gguf_dequantize(weight.segments[0].data.numpy(), GGMLQuantizationType(fmt.ggml_type)).reshape(6, cols)
    assert torch.equal(weight.dequantize(), torch.from_numpy(np.asarray(want, dtype=np.float32)))
    assert weight.nbytes == 6 * fmt.row_bytes(cols) and weight.shape == (6, cols)


@settings(max_examples=25)
@given(st.lists(st.tuples(st.sampled_from(sorted(FORMATS)), st.integers(1, 5)), min_size=1, max_size=4),
       st.integers(0, 2**16))
def test_stacking_and_splitting_move_rows_exactly(parts: list[tuple[str, int]], seed: int) -> None:
    cols = 256
    weights = [weight_in(name, rows, cols, seed + i) for i, (name, rows) in enumerate(parts)]
    stacked = cat_rows(weights)
    assert isinstance(stacked, QuantizedWeight)
    assert torch.equal(stacked.dequantize(), torch.cat([w.dequantize() for w in weights]))
    # adjacent parts of one format merge into one segment
    assert all(a.format != b.format for a, b in zip(stacked.segments, stacked.segments[1:]))
    assert stacked.nbytes == sum(w.nbytes for w in weights)
    first = weights[0]
    rows = first.shape[0]
    sizes = [rows // 2, rows - rows // 2] if rows > 1 else [rows]
    pieces = split_rows(first, sizes)
    assert torch.equal(torch.cat([p.dequantize() for p in pieces]), first.dequantize())
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    moved = reorder_rows(first, lambda data: data[order])
    assert torch.equal(moved.dequantize(), first.dequantize()[order])


def test_a_dense_part_widens_the_quantized_ones() -> None:
    quantized = weight_in("q8_0", 3, 64, 4)
    dense = torch.randn(2, 64, dtype=torch.bfloat16)
    stacked = cat_rows([quantized, dense])
    assert isinstance(stacked, torch.Tensor) and stacked.dtype == torch.bfloat16
    assert torch.equal(stacked[:3], quantized.dequantize(torch.bfloat16)) and torch.equal(stacked[3:], dense)


def test_bad_segments_are_refused() -> None:
    fmt = FORMATS["q8_0"]
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight.of(fmt, torch.zeros(2, 34, dtype=torch.int8), 32)
    with pytest.raises(ValueError, match="take 34 bytes"):
        QuantizedWeight.of(fmt, torch.zeros(2, 36, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="within one format"):
        cat_rows([weight_in("q8_0", 2, 256, 0), weight_in("q4_k", 2, 256, 0)]).map_rows(lambda d: d)
    with pytest.raises(ValueError, match="same columns"):
        cat_rows([weight_in("q8_0", 2, 256, 0), weight_in("q8_0", 2, 512, 0)])


@pytest.mark.parametrize("name", LOAD_FORMATS)
def test_quantizing_at_load_writes_gguf_s_blocks(name: str) -> None:
    weight = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    got = quantize(weight, load_format(name))
    want = gguf_quantize(weight.numpy(), GGMLQuantizationType(FORMATS[name].ggml_type))
    assert np.array_equal(got.segments[0].data.numpy(), want.reshape(5, -1))
    # The reference error of a 32-weight block format: half a step of the block's scale d, where d spans the
    # block's largest magnitude in 127 (8 bits), 8 (4 bits) or 16 (5 bits) steps, or Q4_1's max - min in 15.
    # Q4_0 and Q5_0 put the signed extreme at -8 or -16 steps, so the other end reaches only +7 or +15: a value
    # there is off by up to a whole step. d (and Q4_1's minimum) are then stored in fp16, each off by up to
    # 2^-11 relative, which moves a value by at most its level count times that, plus 2^-11 of the minimum.
    error = (got.dequantize() - weight).abs().view(5, 3, 32)
    blocks = weight.view(5, 3, 32)
    levels = {"q8_0": 127, "q4_0": 8, "q4_1": 15, "q5_0": 16}[name]
    low = blocks.amin(-1, keepdim=True)
    span = blocks.abs().amax(-1, keepdim=True) if name != "q4_1" else blocks.amax(-1, keepdim=True) - low
    step = span / levels
    fp16 = 2.0 ** -11
    rounding = 1.0 if name in ("q4_0", "q5_0") else 0.5
    bound = step * (rounding + levels * fp16) + (low.abs() * fp16 if name == "q4_1" else 0) + 1e-6
    assert bool((error <= bound).all())


def test_formats_without_a_quantizer_or_a_whole_block_are_refused() -> None:
    with pytest.raises(ValueError, match="only as a GGUF file stores it"):
        quantize(torch.randn(2, 256), FORMATS["q4_k"])
    with pytest.raises(ValueError, match="32-weight blocks"):
        quantize(torch.randn(2, 40), FORMATS["q8_0"])
    with pytest.raises(ValueError, match="unknown weight format"):
        load_format("q2_k")


def test_the_weights_choice() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_weights("auto", gguf=True, device=cpu).keep_quantized
    assert not choose_weights("auto", gguf=True, device=cuda).keep_quantized  # no CUDA kernels: widened
    assert not choose_weights("auto", gguf=False, device=cpu).keep_quantized
    assert not choose_weights("widen", gguf=True, device=cpu).keep_quantized
    chosen = choose_weights("q8_0", gguf=False, device=cpu)
    assert chosen.quantize_to is FORMATS["q8_0"] and "q8_0" in chosen.reason
    with pytest.raises(ValueError, match="on cuda use auto or widen"):
        choose_weights("q4_0", gguf=True, device=cuda)
    with pytest.raises(ValueError, match="unknown weights choice"):
        choose_weights("int4", gguf=True, device=cpu)
    assert WEIGHTS_CHOICES == ("auto", "widen", *LOAD_FORMATS)
