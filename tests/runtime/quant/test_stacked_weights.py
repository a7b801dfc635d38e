"""Quantized weights stacking a mixture-of-experts layer's experts, `[experts, rows, cols]`.

Every row is quantized and stored on its own, so a stacked weight must be exactly its experts' weights
side by side: quantizing the stack writes each expert's blocks byte for byte as quantizing that expert
alone; one expert's weight is a view of its slice, never requantized; widening a slice is slicing the
widened stack; and the layer built for one expert (`LinearFactory.experts`) is the layer built from that
expert's 2-D weight, to the bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import built_kernels, needs_compiler
from quant_weights import random_blocks

from ferrox_batch.runtime.architectures.checkpoint_taker import CheckpointTaker
from ferrox_batch.runtime.architectures.linear_factory import LinearFactory
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear, pack, pack_experts
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.quant.formats import FORMATS
from ferrox_batch.runtime.quant.quantize import LOAD_FORMATS, quantizable, quantize
from ferrox_batch.runtime.quant.weight import QuantizedWeight, Segment, cat_rows, reorder_rows, split_rows

#: The formats gguf's quantizer writes here, and the K-quants a file stores (random blocks, finite scales).
STORED_ONLY = tuple(name for name in FORMATS if name not in LOAD_FORMATS)


def normals(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def stacked_blocks(name: str, experts: int, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """A stacked weight in `name`: quantized normals where gguf quantizes it, else random blocks."""
    if name in LOAD_FORMATS:
        return quantize(normals((experts, rows, cols), seed), FORMATS[name])
    raw = random_blocks(FORMATS[name], experts * rows, cols, seed)
    return QuantizedWeight.of(FORMATS[name], raw, cols, experts=experts)


def data_of(weight: QuantizedWeight) -> list[torch.Tensor]:
    return [s.data for s in weight.segments]


@settings(max_examples=30)
@given(name=st.sampled_from(LOAD_FORMATS), experts=st.integers(1, 4), rows=st.integers(1, 6),
       blocks=st.integers(1, 3), seed=st.integers(0, 2 ** 16), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_quantizing_a_stack_is_quantizing_each_expert(name: str, experts: int, rows: int, blocks: int, seed: int,
                                                      scale: float) -> None:
    fmt = FORMATS[name]
    cols = blocks * fmt.block_elems
    values = normals((experts, rows, cols), seed) * scale
    assert quantizable(values, fmt) and quantizable(values[0], fmt)
    stacked = quantize(values, fmt)
    assert stacked.shape == (experts, rows, cols) and stacked.experts == experts
    assert stacked.nbytes == experts * rows * fmt.row_bytes(cols)
    for e in range(experts):
        alone = quantize(values[e], fmt)
        assert stacked[e].shape == (rows, cols) and stacked[e].experts is None
        assert torch.equal(stacked.expert(e).segments[0].data, alone.segments[0].data)
        assert torch.equal(stacked[e].segments[0].data, alone.segments[0].data)


@pytest.mark.parametrize("name", FORMATS)
def test_an_expert_is_a_view_of_its_slice_and_widens_as_the_stack_does(name: str) -> None:
    cols = FORMATS[name].block_elems * 2
    stacked = stacked_blocks(name, 3, 5, cols, 7)
    widened = stacked.dequantize()
    assert widened.shape == (3, 5, cols) and widened.dtype == torch.float32
    assert torch.equal(stacked.dequantize(torch.bfloat16), widened.to(torch.bfloat16))
    storage = stacked.segments[0].data.untyped_storage().data_ptr()
    for e in range(3):
        expert = stacked.expert(e)
        assert expert.segments[0].data.untyped_storage().data_ptr() == storage  # no copy of the blocks
        assert torch.equal(expert.dequantize(), widened[e])
    assert torch.equal(stacked[-1].dequantize(), widened[-1])
    with pytest.raises(IndexError):
        stacked.expert(3)
    with pytest.raises(ValueError, match="stacks no experts"):
        stacked[0].expert(0)


def test_stacked_rows_stack_expert_by_expert() -> None:
    """`cat_rows` of stacked weights is each expert's rows stacked (a fused gate/up of every expert), in any
    mix of formats, and dense stacks the same way."""
    gate, up = stacked_blocks("q8_0", 2, 3, 64, 1), stacked_blocks("q4_0", 2, 4, 64, 2)
    more = stacked_blocks("q4_0", 2, 1, 64, 3)
    fused = cat_rows([gate, up, more])
    assert fused.shape == (2, 8, 64) and fused.format_names == ("q8_0", "q4_0")  # adjacent q4_0 merged
    for e in range(2):
        alone = cat_rows([gate[e], up[e], more[e]])
        assert [torch.equal(a, b) for a, b in zip(data_of(fused[e]), data_of(alone), strict=True)] == [True, True]
    dense = cat_rows([gate.dequantize(), normals((2, 4, 64), 4)])
    assert dense.shape == (2, 7, 64) and torch.equal(dense[1, :3], gate.dequantize()[1])
    mixed = cat_rows([gate, normals((2, 4, 64), 4)])
    assert torch.equal(mixed, dense)
    with pytest.raises(ValueError, match="the same experts"):
        cat_rows([gate, up[0]])


@needs_compiler
def test_row_moves_and_single_layers_refuse_a_stack(kernels: CpuKernels) -> None:
    stacked = stacked_blocks("q8_0", 2, 4, 64, 5)
    with pytest.raises(ValueError, match="stacks 2 experts"):
        split_rows(stacked, [2, 2])
    with pytest.raises(ValueError, match="stacks 2 experts"):
        reorder_rows(stacked, lambda rows: rows.flip(0))
    with pytest.raises(ValueError, match="one expert's weight at a time"):
        pack(stacked, kernels)
    with pytest.raises(ValueError, match="one expert's weight"):
        QuantizedLinear(stacked, None, kernels)
    with pytest.raises(ValueError, match="stack the same experts"):
        QuantizedWeight((stacked.segments[0], Segment(FORMATS["q8_0"], stacked.segments[0].data[0])), 64)
    with pytest.raises(ValueError, match="stack the same experts"):
        QuantizedWeight((stacked.segments[0], Segment(FORMATS["q8_0"], stacked.segments[0].data[:1])), 64)


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


@needs_compiler
@pytest.mark.parametrize("name", FORMATS)
def test_pack_experts_is_each_expert_packed(kernels: CpuKernels, name: str) -> None:
    cols = FORMATS[name].block_elems
    stacked = stacked_blocks(name, 3, 16, cols, 6)
    packed = pack_experts(stacked, kernels)
    rows = torch.arange(16)
    for e, expert in enumerate(packed):
        assert expert.shape == (16, cols) and expert.nbytes == pack(stacked[e], kernels).nbytes
        assert torch.equal(expert.rows(rows, torch.float32), stacked[e].dequantize())


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_activations", [True, False])
@pytest.mark.parametrize("name", ["q8_0", "q5_0", "q6_k"])
def test_an_expert_s_quantized_layer_is_its_2d_layer(kernels: CpuKernels, dtype: torch.dtype,
                                                     int8_activations: bool, name: str) -> None:
    factory = LinearFactory.build(device="cpu", dtype=dtype, kernels=kernels, int8_activations=int8_activations)
    cols = FORMATS[name].block_elems
    stacked = stacked_blocks(name, 3, 24, cols, 8)
    bias = normals((3, 24), 9, dtype)
    x = normals((5, cols), 10, dtype)
    layers = factory.experts(stacked, bias)
    assert len(layers) == 3
    for e, layer in enumerate(layers):
        alone = QuantizedWeight.of(FORMATS[name], stacked[e].segments[0].data.clone(), cols)  # its own copy
        want = factory.linear(alone, bias[e].clone())
        assert layer.kind == want.kind == name
        assert torch.equal(layer(x), want(x))
    gated = stacked_blocks(name, 2, 32, cols, 11)
    for activation in ("silu", "gelu_pytorch_tanh"):
        for e, layer in enumerate(factory.gate_up_experts(gated, activation)):
            alone = QuantizedWeight.of(FORMATS[name], gated[e].segments[0].data.clone(), cols)
            assert torch.equal(layer(x), factory.gate_up(alone, activation)(x))


@needs_compiler
@pytest.mark.parametrize(("dtype", "weights_format", "invariant"), [
    (torch.float32, "dtype", False), (torch.float32, "fp16", False), (torch.bfloat16, "dtype", False),
    (torch.bfloat16, "dtype", True),
])
def test_an_expert_s_dense_layer_is_its_2d_layer(kernels: CpuKernels, dtype: torch.dtype, weights_format: str,
                                                 invariant: bool) -> None:
    factory = LinearFactory.build(device="cpu", dtype=dtype, kernels=kernels, weights_format=weights_format,
                                  batch_invariant=invariant, narrow_panels=True)
    stacked = normals((3, 24, 64), 12, dtype)
    x = normals((5, 64), 13, dtype)
    for e, layer in enumerate(factory.experts(stacked)):
        want = factory.linear(stacked[e].clone(), narrow=False)
        assert layer.kind == want.kind and not layer.narrow_only  # no narrow steps' copy for an expert
        assert torch.equal(layer(x), want(x))
    gated = normals((2, 48, 64), 14, dtype)
    for e, layer in enumerate(factory.gate_up_experts(gated, "silu")):
        want = factory.gate_up(gated[e].clone(), "silu", narrow=False)
        assert layer.kind == want.kind and layer.fused == want.fused
        assert torch.equal(layer(x), want(x))


@needs_compiler
def test_a_stacked_checkpoint_tensor_is_prepared_stacked(kernels: CpuKernels) -> None:
    """Taken from a checkpoint, a 3-D expert weight is quantized stacked at load, or kept as stored."""
    values = normals((2, 8, 64), 15)
    to = LinearFactory.build(device="cpu", dtype=torch.float32, kernels=kernels, quantize_to=FORMATS["q4_0"])
    got = CheckpointTaker({"experts": values}, to.prepare)("experts", (2, 8, 64))
    assert isinstance(got, QuantizedWeight) and got.shape == (2, 8, 64)
    assert torch.equal(got.segments[0].data, quantize(values, FORMATS["q4_0"]).segments[0].data)
    stored = quantize(values, FORMATS["q8_0"])
    keep = LinearFactory.build(device="cpu", dtype=torch.float32, kernels=kernels, keep_quantized=True)
    assert CheckpointTaker({"experts": stored}, keep.prepare)("experts", (2, 8, 64)) is stored


def test_of_reads_a_file_s_stacked_array() -> None:
    """A GGUF reader's array of a stacked tensor (any shape holding whole rows) is copied, expert by expert."""
    fmt = FORMATS["q8_0"]
    raw = quantize(normals((3, 4, 64), 16), fmt).segments[0].data.numpy()
    flat = np.ascontiguousarray(raw.reshape(-1))
    weight = QuantizedWeight.of(fmt, flat, 64, experts=3)
    assert weight.shape == (3, 4, 64) and not np.shares_memory(weight.segments[0].data.numpy(), flat)
    assert torch.equal(weight.segments[0].data, torch.from_numpy(raw))
