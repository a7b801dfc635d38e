"""`MoeBlock` against a dense float64 reference: every expert run on every row, weighted by the router's
weights (zero for the experts a row did not choose), plus the shared expert times its sigmoid gate.

The block's output must lie within the bound its float32 arithmetic allows (`reference`), on torch's
kernels, on the C kernels, on the C kernels' fp16-weight panels (the weights drawn fp16-exact, so the
reference is the same), and with its experts quantized to q8_0 (the reference then over the dequantized
weights, the int8 kernel's quantization of each layer's input added to the bound). A row must get the
same result within that bound alone as in any batch; a decode step of one row must run exactly its k
experts, once each; rows all routed to the same experts, and experts no row chose, must work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numerics import TORCH_SOFTMAX_EXP_ULPS, gamma, unit_roundoff

from ferrox_batch.runtime.architectures.decoder import Decoder
from ferrox_batch.runtime.architectures.forward_context import ForwardContext
from ferrox_batch.runtime.architectures.gated_mlp import GatedMlp
from ferrox_batch.runtime.architectures.linear_factory import LinearFactory
from ferrox_batch.runtime.architectures.moe import MoeBlock
from ferrox_batch.runtime.architectures.router import route
from ferrox_batch.runtime.families.moe_spec import RouterSpec
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.quant.formats import FORMATS

U = unit_roundoff(torch.float32)
#: One SiLU or sigmoid and the product after it: exp (taken at the 20 ulps torch's fast exp is documented
#: within, 2 u each; the C kernels' -ffast-math expf is within fewer), the sum with 1, the quotient and the
#: product (u each), and u more for the second-order terms of those factors.
RHO = (2 * TORCH_SOFTMAX_EXP_ULPS + 4) * U
#: The largest slope of SiLU (1.0998 at g = 2.4) and of the sigmoid (1/4 at 0).
SILU_SLOPE, SIGMOID_SLOPE = 1.1, 0.25


@dataclass(frozen=True, slots=True)
class Weights:
    """A block's float32 weights: the router's, the experts' stacked `[E, 2f, h]` gate/up and `[E, h, f]`
    down, and the shared expert's (`[2s, h]`, `[h, s]`) and its gate's `[1, h]` where it has them."""

    router: torch.Tensor
    router_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None


def draw_weights(gen: torch.Generator, experts: int, hidden: int, ff: int, shared: int, router_bias: bool = False
                 ) -> Weights:
    """fp16-exact normals of a scale that keeps every layer's outputs near one (the fp16 panels then hold
    them exactly); `shared`: 0 none, 1 a shared expert, 2 one with its gate."""
    def normal(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / fan_in ** 0.5).half().float()

    s = 2 * ff
    return Weights(
        router=normal(experts, hidden, fan_in=1), router_bias=normal(experts, fan_in=1) if router_bias else None,
        gate_up=normal(experts, 2 * ff, hidden, fan_in=hidden), down=normal(experts, hidden, ff, fan_in=ff),
        shared_gate_up=normal(2 * s, hidden, fan_in=hidden) if shared else None,
        shared_down=normal(hidden, s, fan_in=s) if shared else None,
        shared_gate=normal(1, hidden, fan_in=hidden) if shared == 2 else None)


def build(factory: LinearFactory, w: Weights, spec: RouterSpec) -> MoeBlock:
    shared = None
    if w.shared_gate_up is not None:
        shared = GatedMlp(factory.gate_up(factory.prepare(w.shared_gate_up), "silu"),
                          factory.linear(factory.prepare(w.shared_down)))
    return MoeBlock(router=spec, router_weight=w.router, router_bias=w.router_bias,
                    gate_up=factory.gate_up_experts(factory.prepare(w.gate_up), "silu"),
                    down=factory.experts(factory.prepare(w.down)), shared=shared, shared_gate=w.shared_gate)


def context(kernels: object, rows: int) -> ForwardContext:
    """What `MoeBlock.forward` reads of a forward: the kernels and eps; the rest is never touched."""
    return ForwardContext(kernels=kernels, store=None, groups=[], plans=[], rope={}, rope_rows=None, rows=rows,
                          eps=1e-6)


def int8_step(v: torch.Tensor) -> torch.Tensor:
    """How far the int8 kernel's quantization may move each element of rows whose magnitudes are at most `v`
    (`quant_weights.assert_sums_of_quantized_x`: each 32-block's dx * (1/2 + 636 u), dx = amax / 127 (1 + 2u))."""
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // 32, 32).amax(-1, keepdim=True)
    step = blocks / 127 * (1 + 2 * U) * (0.5 + 636 * U)
    return step.expand(*blocks.shape[:-1], 32).reshape(v.shape)


def mlps(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, int8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of the `[E, 2f, h]` / `[E, h, f]` gated MLPs on each row of x: `(y, error)`, `[rows, E, h]`.

    Each projection sums its products in float32, within gamma(terms) of their magnitudes (the weights are
    exact in every kernel here: float32, fp16-exact, or the quantized ones' own decodes). The int8 kernel
    first moves each input by up to its block's step (`int8_step`), an error of step @ |w| more. SiLU's
    slope carries the gate's error, the up's carries through |silu(g)|, and the activation rounds within
    RHO; down then sums f products of that."""
    gate, up = gate_up.chunk(2, dim=1)
    x = x.double()
    xs = int8_step(x.abs()) if int8 else torch.zeros_like(x)
    g, u = torch.einsum("rh,efh->ref", x, gate), torch.einsum("rh,efh->ref", x, up)
    eg, eu = (torch.einsum("rh,efh->ref", xs, w.abs()) + gamma(x.shape[1]) * torch.einsum("rh,efh->ref", x.abs() + xs,
                                                                                          w.abs()) for w in (gate, up))
    silu = F.silu(g)
    a = silu * u
    ea = SILU_SLOPE * eg * (u.abs() + eu) + silu.abs() * eu + RHO * (silu.abs() + SILU_SLOPE * eg) * (u.abs() + eu)
    as_ = int8_step(a.abs() + ea) if int8 else torch.zeros_like(a)
    y = torch.einsum("ref,ehf->reh", a, down)
    ey = (torch.einsum("ref,ehf->reh", ea + as_, down.abs())
          + gamma(a.shape[-1]) * torch.einsum("ref,ehf->reh", a.abs() + ea + as_, down.abs()))
    return y, ey


def reference(block_x: torch.Tensor, w: Weights, spec: RouterSpec, int8: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(output, bound, ids)` for the float32 rows `block_x`: the router's own float32 choice and weights
    (what the block computes, the same call on the same rows), then everything else in float64.

    Each chosen expert's float32 output is within its error E of y; multiplying by its weight rounds once
    (u); a row's k products and the shared expert's are summed in float32 (gamma(k + 1) of their magnitudes).
    The shared expert's gate: x @ g summed in float32 (gamma(h)), carried by the sigmoid's slope, then the
    sigmoid's own roundings (RHO); its product with the shared output one more rounding."""
    logits = F.linear(block_x, w.router, w.router_bias)
    weights, ids = route(logits, spec)
    y, ey = mlps(block_x, w.gate_up.double(), w.down.double(), int8)
    dense = torch.zeros(block_x.shape[0], spec.experts, dtype=torch.float64).scatter_(1, ids, weights.double())
    out = torch.einsum("re,reh->rh", dense, y)
    error = torch.einsum("re,reh->rh", dense, ey * (1 + U) + U * y.abs())
    terms = torch.einsum("re,reh->rh", dense, (y.abs() + ey) * (1 + U))
    if w.shared_gate_up is not None:
        ys, es = (t[:, 0] for t in mlps(block_x, w.shared_gate_up[None].double(), w.shared_down[None].double(), int8))
        gate, egate = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        if w.shared_gate is not None:
            x = block_x.double()
            gate = torch.sigmoid(x @ w.shared_gate.double().T)
            egate = SIGMOID_SLOPE * gamma(x.shape[1]) * (x.abs() @ w.shared_gate.double().abs().T) + RHO * gate
        shared = ys * gate
        eshared = ys.abs() * egate + gate * es + es * egate + U * (ys.abs() + es) * (gate + egate)
        out, error, terms = out + shared, error + eshared, terms + shared.abs() + eshared
    return out, error + gamma(spec.top_k + 1) * terms, ids


@pytest.fixture(scope="module")
def kernels() -> CpuKernels | None:
    """The C kernels a float32 decoder runs here (built once per process, so not at collection)."""
    return Decoder.kernels_for(torch.device("cpu"), torch.float32)


def factory_for(kind: str, kernels: CpuKernels | None) -> LinearFactory:
    if kind != "torch" and kernels is None:
        pytest.skip("the C kernels did not build here (no compiler, or they failed their check)")
    return LinearFactory.build(device="cpu", dtype=torch.float32, kernels=None if kind == "torch" else kernels,
                               weights_format="fp16" if kind == "fp16" else "dtype")


def router_is_decisive(x: torch.Tensor, w: Weights, spec: RouterSpec) -> bool:
    """Every row's k-th and (k+1)-th logits further apart than float32's sums of them can blur (so its
    choice is the same in any batch): gamma(h) of their magnitudes, twice, with room to spare."""
    if spec.top_k == spec.experts:
        return True
    logits = x.double() @ w.router.double().T
    magnitude = x.double().abs() @ w.router.double().abs().T
    top = logits.topk(spec.top_k + 1, dim=-1)
    blur = 4 * gamma(x.shape[1]) * magnitude.gather(1, top.indices).amax(-1)
    return bool((top.values[:, -2] - top.values[:, -1] > blur).all())


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, note: str) -> None:
    error = (got.double() - want).abs()
    assert bool((error <= bound).all()), f"{note}: {float((error / bound).max()):.3g} times the bound"


@pytest.mark.parametrize("kind", ["torch", "kernels", "fp16"])
@settings(max_examples=25)
@given(rows=st.integers(1, 40), experts=st.integers(1, 12), data=st.data(), hidden=st.sampled_from([8, 16, 32]),
       ff=st.sampled_from([4, 8, 24]), shared=st.integers(0, 2), renormalize=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_the_block_is_the_dense_reference_alone_or_batched(kernels: CpuKernels | None, kind: str, rows: int,
                                                           experts: int, data: st.DataObject, hidden: int, ff: int,
                                                           shared: int, renormalize: bool, seed: int) -> None:
    factory = factory_for(kind, kernels)
    spec = RouterSpec(experts=experts, top_k=data.draw(st.integers(1, experts)), renormalize=renormalize)
    gen = torch.Generator().manual_seed(seed)
    w = draw_weights(gen, experts, hidden, ff, shared)
    x = torch.randn(rows, hidden, generator=gen)
    assume(router_is_decisive(x, w, spec))
    block = build(factory, w, spec)
    if kind == "fp16":  # our fp16-weight kernels run every expert, the gated projections fused
        assert {layer.kind for layer in block.linears()} == {"fp16_panels"}
    got = block.forward(x, context(factory.kernels, rows))
    assert got.dtype == torch.float32 and got.shape == x.shape
    want, bound, ids = reference(x, w, spec)
    assert_within(got, want, bound, "batched")
    for r in range(rows):
        alone = block.forward(x[r:r + 1].clone(), context(factory.kernels, 1))
        want_r, bound_r, ids_r = reference(x[r:r + 1].clone(), w, spec)
        assert torch.equal(ids_r[0].sort().values, ids[r].sort().values), f"row {r} chose other experts alone"
        assert_within(alone[0], want_r[0], bound_r[0], f"row {r} alone")
        assert_within(alone[0], got[r].double(), bound[r] + bound_r[0], f"row {r} alone against batched")


class Counting:
    """A layer that records the row counts it is called with."""

    def __init__(self, layer: object) -> None:
        self.layer, self.calls = layer, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return self.layer(x)


def count_calls(block: MoeBlock) -> tuple[list[Counting], list[Counting]]:
    block.gate_up = tuple(Counting(layer) for layer in block.gate_up)
    block.down = tuple(Counting(layer) for layer in block.down)
    return list(block.gate_up), list(block.down)


@pytest.mark.parametrize("kind", ["torch", "kernels"])
def test_a_decode_step_runs_exactly_its_k_experts_once_each(kernels: CpuKernels | None, kind: str) -> None:
    factory = factory_for(kind, kernels)
    spec = RouterSpec(experts=10, top_k=3)
    gen = torch.Generator().manual_seed(5)
    w = draw_weights(gen, 10, 16, 8, 1)
    for step in range(6):
        block = build(factory, w, spec)
        gate_up, down = count_calls(block)
        x = torch.randn(1, 16, generator=gen)
        block.forward(x, context(factory.kernels, 1))
        chosen = set(route(F.linear(x, w.router), spec)[1][0].tolist())
        assert len(chosen) == 3
        for e in range(10):
            want = [1] if e in chosen else []
            assert gate_up[e].calls == want and down[e].calls == want, f"step {step}, expert {e}"
    # A batch: each expert with rows runs once, over all of them; the others not at all.
    x = torch.randn(9, 16, generator=gen)
    block = build(factory, w, spec)
    gate_up, down = count_calls(block)
    block.forward(x, context(factory.kernels, 9))
    per_expert = torch.bincount(route(F.linear(x, w.router), spec)[1].flatten(), minlength=10).tolist()
    for e, count in enumerate(per_expert):
        assert gate_up[e].calls == down[e].calls == ([count] if count else [])


@pytest.mark.parametrize("kind", ["torch", "kernels"])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_rows_all_routed_alike_leave_the_other_experts_idle(kernels: CpuKernels | None, kind: str, top_k: int) -> None:
    """A zero router with a bias sends every row to the bias's top k experts; the rest get no rows."""
    factory = factory_for(kind, kernels)
    gen = torch.Generator().manual_seed(top_k)
    w = draw_weights(gen, 8, 16, 8, 2)
    w = replace(w, router=torch.zeros(8, 16), router_bias=torch.tensor([0.0, 3.0, -1.0, 2.0, 1.0, 2.5, -2.0, 0.5]))
    spec = RouterSpec(experts=8, top_k=top_k, bias=True, renormalize=True)
    block = build(factory, w, spec)
    gate_up, _ = count_calls(block)
    x = torch.randn(13, 16, generator=gen)
    got = block.forward(x, context(factory.kernels, 13))
    want, bound, ids = reference(x, w, spec)
    assert set(ids.flatten().tolist()) == set([1, 5, 3, 4][:top_k])
    assert [len(g.calls) for g in gate_up] == [1 if e in [1, 5, 3, 4][:top_k] else 0 for e in range(8)]
    assert_within(got, want, bound, "alike")


@pytest.mark.parametrize("int8_activations", [False, True])
@settings(max_examples=10)
@given(rows=st.integers(1, 24), experts=st.integers(1, 6), data=st.data(), hidden=st.sampled_from([32, 64]),
       shared=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
def test_quantized_experts_are_the_block_over_their_dequantized_weights(kernels: CpuKernels | None,
                                                                       int8_activations: bool, rows: int,
                                                                       experts: int, data: st.DataObject,
                                                                       hidden: int, shared: int, seed: int) -> None:
    """q8_0 experts (and shared expert) against the float64 reference over the weights they decode to, and
    the dense block over those weights: the weight-only kernel's float32 sums are as the dense layers' (the
    decodes are exact), so the dense bound holds; the int8 kernel adds its quantization of each input."""
    if kernels is None:
        pytest.skip("quantized experts run on the C kernels, which did not build here")
    quantized = LinearFactory.build(device="cpu", dtype=torch.float32, kernels=kernels,
                                    quantize_to=FORMATS["q8_0"], int8_activations=int8_activations)
    spec = RouterSpec(experts=experts, top_k=data.draw(st.integers(1, experts)), renormalize=True)
    gen = torch.Generator().manual_seed(seed)
    w = draw_weights(gen, experts, hidden, 32, shared)
    block = build(quantized, w, spec)
    assert {layer.kind for layer in block.linears()} == {"q8_0"}
    widened = replace(w, gate_up=quantized.prepare(w.gate_up).dequantize(),
                      down=quantized.prepare(w.down).dequantize(),
                      shared_gate_up=None if not shared else quantized.prepare(w.shared_gate_up).dequantize(),
                      shared_down=None if not shared else quantized.prepare(w.shared_down).dequantize())
    x = torch.randn(rows, hidden, generator=gen)
    got = block.forward(x, context(kernels, rows))
    want, bound, _ = reference(x, widened, spec, int8=int8_activations)
    assert_within(got, want, bound, "quantized")
    dense = build(factory_for("torch", None), widened, spec).forward(x, context(None, rows))
    _, dense_bound, _ = reference(x, widened, spec)
    assert_within(got, dense.double(), bound + dense_bound, "quantized against the dense block")
