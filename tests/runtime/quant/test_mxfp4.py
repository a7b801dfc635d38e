"""MXFP4: the format's dequantization against a float64 reference written from the specification (FP4
E2M1 codes times an E8M0 power of two, 255 read as 2^128 as llama.cpp reads it), the published safetensors
layout converted to GGML's blocks against transformers' own dequantization, and stacked MXFP4 experts
through `LinearFactory`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import built_kernels, needs_compiler
from quant_weights import assert_exact_sums, random_blocks
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from ferrox_batch.runtime.architectures.linear_factory import LinearFactory
from ferrox_batch.runtime.architectures.quantized_linear import formats_that_run
from ferrox_batch.runtime.quant.formats import FORMATS
from ferrox_batch.runtime.quant.mxfp4 import from_blocks
from ferrox_batch.runtime.quant.weight import QuantizedWeight

MXFP4 = FORMATS["mxfp4"]


def fp4(code: int) -> float:
    """An E2M1 code's value: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0; exponent 0 subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))


def spec_rows(raw: torch.Tensor) -> torch.Tensor:
    """GGML MXFP4 rows `[n, row_bytes]` dequantized in float64 from the specification (codes j and j + 16
    in the low and high nibbles of byte j), then rounded to float32 (exact, or infinite past its range)."""
    blocks = raw.reshape(raw.shape[0], -1, MXFP4.block_bytes).long()
    scale = torch.pow(2.0, blocks[..., 0].double() - 127)
    codes = torch.cat((blocks[..., 1:] & 15, blocks[..., 1:] >> 4), dim=-1)
    values = torch.tensor([fp4(c) for c in range(16)], dtype=torch.float64)[codes] * scale[..., None]
    return values.reshape(raw.shape[0], -1).float()


def every_exponent(seed: int) -> torch.Tensor:
    """256 rows of two blocks: row e has both exponents e, its codes random (every code occurs)."""
    raw = random_blocks(MXFP4, 256, 64, seed).reshape(256, 2, MXFP4.block_bytes)
    raw[:, :, 0] = torch.arange(256, dtype=torch.uint8)[:, None]
    return raw.reshape(256, -1).contiguous()


def test_the_format_is_ggml_s_mxfp4() -> None:
    from gguf import GGML_QUANT_SIZES

    assert (MXFP4.ggml_type, MXFP4.block_elems, MXFP4.block_bytes) == (39, 32, 17)
    assert GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4] == (32, 17) and MXFP4.bits_per_weight == 4.25


@pytest.mark.filterwarnings("ignore:overflow encountered")  # gguf's multiply, where e >= 253 overflows
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantization_is_the_specification_s_at_every_exponent(seed: int) -> None:
    """gguf's dequantization (what `QuantizedWeight.dequantize` runs, and the kernels' tests compare with)
    is the specification's value for every exponent byte: subnormal scales at 0 and 1, 255 as 2^128, and
    the infinities where a value passes float32's range (e >= 253) as they come."""
    raw = every_exponent(seed)
    want = spec_rows(raw)
    got = QuantizedWeight.of(MXFP4, raw, 64).dequantize()
    direct = torch.from_numpy(np.asarray(gguf_dequantize(raw.numpy(), GGMLQuantizationType.MXFP4))).reshape(256, 64)
    assert torch.equal(got, want) and torch.equal(direct, want)
    assert bool(want[:253].isfinite().all()) and not bool(want[253:].isfinite().all())
    assert float(want[0].abs().max()) <= 6 * 2.0**-127 and float(want[0].abs().max()) > 0


@settings(max_examples=30, deadline=None)
@given(experts=st.integers(1, 3), rows=st.integers(1, 5), groups=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_converted_blocks_dequantize_as_transformers_does(experts: int, rows: int, groups: int, seed: int) -> None:
    """Random codes and exponents (up to 252, where nothing overflows), stacked and 2-D: transformers'
    float32 dequantization, turned back to `[out, in]` rows, is ours exactly (its -0 is our +0)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 253, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    weight = from_blocks(blocks, scales)
    assert weight.shape == (experts, rows, 32 * groups) and weight.format_names == ("mxfp4",)
    assert weight.nbytes == experts * rows * groups * 17
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    ours = weight.dequantize()
    assert torch.equal(ours, theirs)
    differ = ours.view(torch.int32) != theirs.view(torch.int32)
    assert bool((ours[differ] == 0).all())  # only the sign of a zero
    alone = from_blocks(blocks[0], scales[0])
    assert alone.experts is None and torch.equal(alone.segments[0].data, weight.segments[0].data[0])


def test_the_extreme_exponents_convert_where_they_stay_finite() -> None:
    """e = 0 and 1 (subnormal scales), and 253, 254, 255 with the codes whose values stay below 2^128 (255 is
    2^128: only the codes of 0 and 0.5 are finite there), against transformers' dequantization."""
    gen = torch.Generator().manual_seed(3)
    finite_below = {253: 6, 254: 4, 255: 2}  # codes & 7 below this keep |value| < 2^128
    scales = torch.tensor([[0, 1, 2, 127], [252, 253, 254, 255]], dtype=torch.uint8)
    blocks = torch.randint(0, 256, (2, 4, 16), generator=gen, dtype=torch.uint8)
    for (row, group), e in np.ndenumerate(scales.numpy()):
        if int(e) in finite_below:
            limit = finite_below[int(e)]
            codes = torch.randint(0, limit, (2, 16), generator=gen) | (torch.randint(0, 2, (2, 16), generator=gen) << 3)
            codes[0, 0] = limit - 1  # the largest finite magnitude is there
            blocks[row, group] = (codes[0] | (codes[1] << 4)).to(torch.uint8)
    weight = from_blocks(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32).transpose(1, 2)[0]
    ours = weight.dequantize()
    assert bool(ours.isfinite().all()) and torch.equal(ours, theirs)
    assert torch.equal(ours, spec_rows(weight.segments[0].data))
    assert float(ours[1, 96:].abs().max()) == 2.0**127  # e = 255: 0.5 * 2^128


@pytest.mark.parametrize(("e", "code", "finite"), [(255, 2, 1), (255, 15, 9), (254, 4, 3), (254, 12, 11),
                                                 (253, 6, 5), (253, 7, 13)])
def test_a_block_that_would_overflow_is_refused(e: int, code: int, finite: int) -> None:
    """The smallest overflowing magnitude at each exponent (2^128 exactly) and the largest, of either sign,
    are refused; the next smaller code converts, finite."""
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8)
    scales = torch.full((2, 3), 127, dtype=torch.uint8)
    blocks[1, 2, 5] = code << 4
    scales[1, 2] = e
    with pytest.raises(ValueError, match=r"block \[1, 2\].*infinity"):
        from_blocks(blocks, scales)
    blocks[1, 2, 5] = finite << 4
    assert bool(from_blocks(blocks, scales).dequantize().isfinite().all())


def test_bad_tensors_are_refused() -> None:
    blocks, scales = torch.zeros(2, 3, 4, 16, dtype=torch.uint8), torch.zeros(2, 3, 4, dtype=torch.uint8)
    cases = [
        (blocks.view(torch.int8), scales, "uint8"),
        (blocks, scales.int(), "uint8"),
        (blocks[..., :8], scales, r"\[\(experts,\) out"),
        (blocks, scales[:, :, :3], r"\[\(experts,\) out"),
        (blocks[0, 0], scales[0, 0], r"\[\(experts,\) out"),
        (blocks[None], scales[None], r"\[\(experts,\) out"),
        (blocks[:, :, :0], scales[:, :, :0], "at least one block"),
    ]
    for b, s, message in cases:
        with pytest.raises(ValueError, match=message):
            from_blocks(b, s)


def test_the_nibbles_move_to_ggml_s_order() -> None:
    """Code 2i of transformers' block (byte i's low nibble) and 2i + 1 (its high one) land in GGML's byte j's
    low nibble for element j < 16, its high nibble for element j + 16; the exponent byte leads."""
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    for i in range(16):
        blocks[0, 0, i] = ((2 * i + 1) % 16) << 4 | (2 * i) % 16
    row = from_blocks(blocks, torch.tensor([[77]], dtype=torch.uint8)).segments[0].data[0]
    assert int(row[0]) == 77
    codes = [int(row[1 + j]) & 15 for j in range(16)] + [int(row[1 + j]) >> 4 for j in range(16)]
    assert codes == [element % 16 for element in range(32)]


@pytest.fixture(scope="module")
def kernels():
    return built_kernels()


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_activations", [True, False])
def test_converted_experts_run_through_the_factory(kernels, dtype: torch.dtype, int8_activations: bool) -> None:
    """gpt-oss-shaped stacked experts (gate_up's rows interleaved, as stored) kept as stored by the factory,
    each expert's layer the one its 2-D weight builds; on exact x (int8 keeps it exactly) each is exact
    arithmetic over the dequantized expert, within the float32 sum's bound."""
    assert "mxfp4" in formats_that_run(kernels, dtype, int8_activations)
    factory = LinearFactory.build(device="cpu", dtype=dtype, kernels=kernels, keep_quantized=True,
                                  int8_activations=int8_activations)
    gen = torch.Generator().manual_seed(4)
    experts, ff, hidden = 3, 32, 64
    gate_up = from_blocks(torch.randint(0, 256, (experts, 2 * ff, hidden // 32, 16), generator=gen, dtype=torch.uint8),
                          torch.randint(118, 126, (experts, 2 * ff, hidden // 32), generator=gen, dtype=torch.uint8))
    down = from_blocks(torch.randint(0, 256, (experts, hidden, ff // 32, 16), generator=gen, dtype=torch.uint8),
                       torch.randint(118, 126, (experts, hidden, ff // 32), generator=gen, dtype=torch.uint8))
    assert factory.prepare(gate_up) is gate_up and factory.prepare(down) is down
    ints = torch.randint(-127, 128, (5, hidden), generator=gen).double()
    ints[:, ::32] = 127
    x = (ints * 2.0**-6).to(dtype)
    bias = torch.randn(experts, 2 * ff, generator=gen).to(dtype)
    widened = gate_up.dequantize()
    for e, layer in enumerate(factory.experts(gate_up, bias)):
        alone = QuantizedWeight.of(MXFP4, gate_up[e].segments[0].data.clone(), hidden)
        assert layer.kind == "mxfp4"
        assert torch.equal(layer(x), factory.linear(alone, bias[e].clone())(x))
        assert_exact_sums(factory.experts(gate_up)[e](x), x, widened[e])
    for e, layer in enumerate(factory.experts(down)):
        h = x[:, :ff].contiguous()
        assert_exact_sums(layer(h), h, down.dequantize()[e])
    for e, layer in enumerate(factory.gate_up_experts(gate_up, "silu")):
        alone = QuantizedWeight.of(MXFP4, gate_up[e].segments[0].data.clone(), hidden)
        assert torch.equal(layer(x), factory.gate_up(alone, "silu")(x))
