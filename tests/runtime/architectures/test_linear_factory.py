"""`LinearFactory` builds exactly the layers the decoder built by hand before it existed.

For every combination of the decoder's knobs this CPU can build (dtype, weight format, C kernels or none,
the batch-invariant preference, the narrow steps' copy, the quantized kernel), the factory's linear, gated
projection and embedding must be the layer constructed directly with the arguments the decoder passed:
the same kernel (`kind`, fused or not, the narrow copy held or not), the same bytes, and the same output
bit for bit (the same kernel over the same weight and input). Its weight preparation must keep, widen
and quantize as the decoder's checkpoint reader did, and the taker must refuse with the messages the
loaders' tests match.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_builds import built_kernels, needs_compiler

from ferrox_batch.runtime.architectures.checkpoint_taker import CheckpointTaker
from ferrox_batch.runtime.architectures.embedding import Embedding
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.linear_factory import LinearFactory
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear, formats_that_run, pack
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.quant.formats import FORMATS
from ferrox_batch.runtime.quant.quantize import quantize
from ferrox_batch.runtime.quant.weight import QuantizedWeight

pytestmark = needs_compiler

OUT, IN = 48, 64
DENSE_KNOBS = list(itertools.product(
    (torch.float32, torch.bfloat16),  # dtype
    ("dtype", "fp16"),  # weights_format
    (True, False),  # C kernels built
    (False, True),  # batch_invariant
    (False, True),  # narrow_panels
))


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


def factory_for(dtype: torch.dtype, weights_format: str, kernels: CpuKernels | None, invariant: bool,
                narrow: bool, int8_activations: bool = True) -> LinearFactory:
    return LinearFactory.build(device="cpu", dtype=dtype, kernels=kernels, weights_format=weights_format,
                               int8_activations=int8_activations, batch_invariant=invariant, narrow_panels=narrow)


def dense(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def same_layer(got: Linear | QuantizedLinear | GateUp, want: Linear | QuantizedLinear | GateUp,
               x: torch.Tensor) -> None:
    assert type(got) is type(want)
    assert got.kind == want.kind and got.nbytes == want.nbytes
    out, ref = got(x), want(x)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize(("dtype", "weights_format", "built", "invariant", "narrow"), DENSE_KNOBS)
def test_a_dense_linear_is_the_one_the_decoder_built(kernels: CpuKernels, dtype: torch.dtype, weights_format: str,
                                                     built: bool, invariant: bool, narrow: bool) -> None:
    k = kernels if built else None
    factory = factory_for(dtype, weights_format, k, invariant, narrow)
    x = dense(5, IN, dtype, 3)
    for bias, keep_weight, narrow_layer in itertools.product((False, True), repeat=3):
        weight = dense(OUT, IN, dtype, 1)
        b = dense(1, OUT, dtype, 2)[0] if bias else None
        got = factory.linear(weight, b, keep_weight=keep_weight, narrow=narrow_layer)
        # What `Decoder._linear` constructed before the factory.
        want = Linear(weight, b, keep_weight=keep_weight, weights=weights_format, kernels=k,
                      batch_invariant=invariant, narrow_panels=narrow_layer and narrow)
        same_layer(got, want, x)
        assert got.narrow_only == want.narrow_only
        assert (got.weight is None) == (want.weight is None)
        assert (got.f16_panels is None) == (want.f16_panels is None)
        assert (got.bf16_panels is None) == (want.bf16_panels is None)


def test_the_knobs_reach_the_kernels_they_name(kernels: CpuKernels) -> None:
    """The comparison above is not vacuous: on this CPU the knobs do pick different kernels."""
    weight32, weight16 = dense(OUT, IN, torch.float32, 1), dense(OUT, IN, torch.bfloat16, 1)
    assert factory_for(torch.float32, "fp16", kernels, False, False).linear(weight32).kind == "fp16_panels"
    assert factory_for(torch.float32, "fp16", None, False, False).linear(weight32).kind != "fp16_panels"
    assert factory_for(torch.bfloat16, "dtype", kernels, True, False).linear(weight16).kind == "bf16_panels"
    narrow = factory_for(torch.bfloat16, "dtype", kernels, False, True)
    assert narrow.linear(weight16).kind == "mkldnn" and narrow.linear(weight16).narrow_only
    assert not narrow.linear(weight16, narrow=False).narrow_only
    assert factory_for(torch.float32, "fp16", kernels, False, False).gate_up(dense(2 * OUT, IN, torch.float32, 1),
                                                                             "silu").fused


@pytest.mark.parametrize(("dtype", "weights_format", "built", "invariant", "narrow"), DENSE_KNOBS)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_a_dense_gate_up_is_the_one_the_decoder_built(kernels: CpuKernels, dtype: torch.dtype, weights_format: str,
                                                      built: bool, invariant: bool, narrow: bool,
                                                      activation: str) -> None:
    k = kernels if built else None
    factory = factory_for(dtype, weights_format, k, invariant, narrow)
    weight = dense(2 * OUT, IN, dtype, 4)
    got = factory.gate_up(weight, activation)
    # What the decoder's `gate_up` lambda constructed before the factory.
    want = GateUp(weight, weights=weights_format, kernels=k, activation=activation, int8_activations=True,
                  batch_invariant=invariant, narrow_panels=narrow)
    same_layer(got, want, dense(5, IN, dtype, 5))
    assert got.fused == want.fused
    assert (got.bf16_gemm is None) == (want.bf16_gemm is None)
    assert (got.packed_gemm is None) == (want.packed_gemm is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_activations", [True, False])
@pytest.mark.parametrize("name", ["q8_0", "q4_1"])
def test_a_quantized_layer_is_the_one_the_decoder_built(kernels: CpuKernels, dtype: torch.dtype,
                                                        int8_activations: bool, name: str) -> None:
    factory = factory_for(dtype, "dtype", kernels, False, False, int8_activations)
    x = dense(5, IN, dtype, 6)
    weight = quantize(dense(OUT, IN, torch.float32, 7), FORMATS[name])
    for bias in (None, dense(1, OUT, dtype, 8)[0]):
        same_layer(factory.linear(weight, bias), QuantizedLinear(weight, bias, kernels, int8_activations), x)
    gated = quantize(dense(2 * OUT, IN, torch.float32, 9), FORMATS[name])
    for activation in ("silu", "gelu_pytorch_tanh"):
        want = GateUp(gated, kernels=kernels, activation=activation, int8_activations=int8_activations)
        same_layer(factory.gate_up(gated, activation), want, x)
    if int8_activations:  # a head tied to a packed embedding multiplies by that packing
        packed = pack(weight, kernels)
        same_layer(factory.linear(packed), QuantizedLinear(packed, None, kernels), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_activations", [True, False])
def test_the_embedding_is_the_one_the_decoder_built(kernels: CpuKernels, dtype: torch.dtype,
                                                    int8_activations: bool) -> None:
    factory = factory_for(dtype, "dtype", kernels, False, False, int8_activations)
    tokens = torch.tensor([0, 5, 5, OUT - 1])
    for weight in (dense(OUT, IN, dtype, 10), quantize(dense(OUT, IN, torch.float32, 10), FORMATS["q8_0"])):
        got, want = factory.embedding(weight), Embedding(weight, dtype, kernels, int8_activations)
        assert type(got.weight) is type(want.weight) and got.nbytes == want.nbytes
        assert torch.equal(got(tokens), want(tokens))


def test_build_checks_the_quantized_formats_once(kernels: CpuKernels) -> None:
    runs = formats_that_run(kernels, torch.float32)
    kept = LinearFactory.build(device="cpu", dtype=torch.float32, kernels=kernels, keep_quantized=True)
    assert kept.keep == runs and kept.quantize_to is None
    assert LinearFactory.build(device="cpu", dtype=torch.float32, kernels=kernels).keep == frozenset()
    to = LinearFactory.build(device="cpu", dtype=torch.float32, kernels=kernels, quantize_to=FORMATS["q8_0"])
    assert to.keep == frozenset() and to.quantize_to == FORMATS["q8_0"]
    with pytest.raises(ModelLoadError, match="cannot be served in q8_0 here: .* did not build"):
        LinearFactory.build(device="cpu", dtype=torch.float32, kernels=None, quantize_to=FORMATS["q8_0"])
    with pytest.raises(ModelLoadError, match="cannot be served in q4_0 here: .* did not pass their check"):
        LinearFactory.build(device="cpu", dtype=torch.float16, kernels=kernels, quantize_to=FORMATS["q4_0"])


def test_prepare_keeps_widens_and_quantizes_as_the_checkpoint_reader_did(kernels: CpuKernels) -> None:
    values = dense(OUT, IN, torch.float32, 11)
    q8, q4 = quantize(values, FORMATS["q8_0"]), quantize(values, FORMATS["q4_0"])
    norm = dense(1, IN, torch.float32, 12)[0]
    keep = LinearFactory(torch.device("cpu"), torch.bfloat16, kernels, keep=frozenset({"q8_0"}))
    assert keep.prepare(q8) is q8  # served as stored
    widened = keep.prepare(q4)  # a format not kept: widened to the decoder's dtype
    assert isinstance(widened, torch.Tensor) and torch.equal(widened, q4.dequantize().to(torch.bfloat16))
    assert torch.equal(keep.prepare(values), values.to(torch.bfloat16))
    to = LinearFactory(torch.device("cpu"), torch.float32, kernels, quantize_to=FORMATS["q4_0"])
    for given in (values, q8):  # dense, or quantized in a format not kept: requantized from float32
        got = to.prepare(given)
        want = quantize(given if isinstance(given, torch.Tensor) else given.dequantize(), FORMATS["q4_0"])
        assert isinstance(got, QuantizedWeight) and got.format_names == ("q4_0",)
        assert torch.equal(got.segments[0].data, want.segments[0].data)
    for unquantizable in (norm, dense(OUT, IN + 1, torch.float32, 13)):  # 1-D, or rows not whole blocks
        got = to.prepare(unquantizable)
        assert isinstance(got, torch.Tensor) and torch.equal(got, unquantizable) and got.is_contiguous()
    none = LinearFactory(torch.device("cpu"), torch.float32, None)
    strided = values.T
    assert torch.equal(none.prepare(strided), strided) and none.prepare(strided).is_contiguous()


def test_the_taker_pops_checks_and_delegates_the_format(kernels: CpuKernels) -> None:
    factory = LinearFactory(torch.device("cpu"), torch.bfloat16, kernels)
    weights = {"a": dense(OUT, IN, torch.float32, 14), "b": dense(2, 3, torch.float32, 15), "c": torch.ones(3)}
    take = CheckpointTaker(weights, factory.prepare)
    got = take("a", (OUT, IN))
    assert got.dtype == torch.bfloat16 and "a" not in weights
    with pytest.raises(ModelLoadError, match=r"checkpoint is missing the tensor 'z'"):
        take("z", (1,))
    with pytest.raises(ModelLoadError, match=r"tensor 'b' has shape \(2, 3\), expected \(3, 2\)"):
        take("b", (3, 2))
    assert set(weights) == {"c"}


def test_batch_invariance_is_asked_of_the_factory(kernels: CpuKernels) -> None:
    on = factory_for(torch.bfloat16, "dtype", kernels, True, False)
    assert on.batch_invariant_over(["bf16_panels", "fp16_panels", "q8_0+q5_0"])
    assert not on.batch_invariant_over(["bf16_panels", "mkldnn"])
    weight_only = factory_for(torch.bfloat16, "dtype", kernels, True, False, int8_activations=False)
    assert not weight_only.batch_invariant_over(["bf16_panels", "q8_0"])
    assert not factory_for(torch.bfloat16, "dtype", None, True, False).batch_invariant_over(["bf16_panels"])


def test_a_stacked_weight_builds_one_layer_per_expert_only(kernels: CpuKernels) -> None:
    factory = factory_for(torch.float32, "dtype", kernels, False, False)
    stacked = torch.randn(2, OUT, IN)
    with pytest.raises(ValueError, match="one layer per expert; use `experts`"):
        factory.linear(stacked)
    with pytest.raises(ValueError, match="one layer per expert; use `gate_up_experts`"):
        factory.gate_up(quantize(stacked, FORMATS["q8_0"]), "silu")
    with pytest.raises(ValueError, match="stacked weight is"):
        factory.experts(stacked[0])
    with pytest.raises(ValueError, match="stacks no experts"):
        factory.gate_up_experts(quantize(stacked[0], FORMATS["q8_0"]), "silu")
    with pytest.raises(ValueError, match="stacked bias"):
        factory.experts(stacked, torch.zeros(3, OUT))
