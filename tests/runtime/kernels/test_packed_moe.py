"""A mixture of experts' routed half in C (`csrc/packed_moe.c`): `PackedMoe` gives exactly what the Python
loop's calls give (the sort, the gather, every expert's gate|up, silu_mul, every down, the weighting and
torch's `index_add_`); the C router (`CpuKernels.moe_route`) picks what a float64 softmax top-k picks
wherever the choice is clear, its weights within float32 rounding, each row's result the same alone or in
any batch; the per-head norms are `rms_norm` run by run; and the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import built_kernels, needs_compiler
from test_packed_experts import experts_of

from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels
from ferrox_batch.runtime.kernels.packed_moe import PackedMoe
from ferrox_batch.runtime.kernels.packed_quant import PackedExperts

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


def python_loop(kernels: CpuKernels, gate_up: PackedExperts, down: PackedExperts, x: torch.Tensor,
                ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What `MoeBlock` did with those calls before they moved to C."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    source = order // k
    counts = torch.bincount(flat, minlength=gate_up.experts)
    hi = counts.cumsum(0)
    lo = hi - counts
    results = down(kernels.silu_mul(gate_up(x[source], lo, hi)), lo, hi).float()
    results *= weights.flatten()[order, None]
    return torch.zeros(x.shape[0], x.shape[1]).index_add_(0, source, results)


def moe_of(kernels: CpuKernels, experts: int, hidden: int, inter: int, names: list[str],
           seed: int) -> tuple[PackedExperts, PackedExperts]:
    gate_up = PackedExperts(experts_of(kernels, names[:experts], 2 * inter, hidden, seed))
    down = PackedExperts(experts_of(kernels, names[experts:2 * experts], hidden, inter, seed + 1))
    return gate_up, down


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 9), experts=st.integers(1, 6), top_k=st.integers(1, 6), bf16=st.booleans(),
       seed=st.integers(0, 2**16),
       names=st.lists(st.sampled_from(["q8_0", "q4_0", "q4_k", "q6_k", "mxfp4", "q5_0"]), min_size=12, max_size=12))
def test_the_experts_in_c_are_the_python_loop_bit_for_bit(kernels, m, experts, top_k, bf16, seed, names):
    top_k = min(top_k, experts)
    gate_up, down = moe_of(kernels, experts, 256, 256, names, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 256, generator=g)
    x = x.bfloat16() if bf16 else x
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)]) if m else \
        torch.empty(0, top_k, dtype=torch.int64)
    weights = torch.rand(m, top_k, generator=g)
    got = PackedMoe(gate_up, down, top_k, True)(x, ids, weights)
    assert got.dtype == torch.float32 and got.shape == (m, 256)
    assert torch.equal(got, python_loop(kernels, gate_up, down, x, ids, weights))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 7), experts=st.integers(1, 40), top_k=st.integers(1, 8), hidden=st.integers(1, 70),
       renormalize=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_the_router_is_a_softmax_top_k_each_row_alone(kernels, m, experts, top_k, hidden, renormalize, bf16, seed):
    top_k = min(top_k, experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g)
    x = x.bfloat16() if bf16 else x
    w = torch.randn(experts, hidden, generator=g)
    weights, ids = kernels.moe_route(x, w, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (m, top_k)
    for r in range(m):  # each row alone gives the same bits: nothing depends on the batch
        alone = kernels.moe_route(x[r:r + 1], w, top_k, renormalize)
        assert torch.equal(alone[0][0], weights[r]) and torch.equal(alone[1][0], ids[r])
    exact = (x.double() @ w.double().T).softmax(-1)
    # float32 logits are within k * |x| |w| * 2^-23-ish of exact; a choice is checked where the gap to the
    # next score beats what such an error moves a softmax score by (|dp| <= p * 2 * max logit error).
    bound = (x.double().abs() @ w.double().abs().T).max(-1).values * hidden * 2**-22 + 2**-20
    top = exact.topk(min(top_k + 1, experts), dim=-1)
    for r in range(m):
        clear = top_k == experts or float(top.values[r, top_k - 1] - top.values[r, top_k]) > 4 * float(bound[r])
        if clear:
            assert set(ids[r].tolist()) == set(top.indices[r, :top_k].tolist())
            want = exact[r, ids[r]]
            if renormalize:
                want = want / want.sum()
            assert torch.allclose(weights[r].double(), want, rtol=0, atol=8 * float(bound[r]) + 2**-20)


def test_ties_go_to_the_lowest_id_and_ids_are_distinct(kernels):
    weights, ids = kernels.moe_route(torch.zeros(3, 8), torch.zeros(6, 8), 4, False)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    assert torch.equal(weights, torch.full((3, 4), 1 / 6))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 5), heads=st.integers(1, 4), kv=st.integers(0, 3), span=st.integers(1, 20),
       bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_head_norms_are_rms_norm_run_by_run(kernels, rows, heads, kv, span, bf16, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    width = (heads + 2 * kv) * span
    qkv = torch.randn(rows, width, generator=g).to(dtype)
    weight = torch.randn(span, generator=g).to(dtype)
    want = qkv.clone()
    for r in range(rows):
        for h in range(heads):
            part = slice(h * span, (h + 1) * span)
            want[r, part] = kernels.rms_norm(qkv[r, part].clone().reshape(1, span), weight, 1e-6)[0]
    got = qkv.clone()
    kernels.head_norms(got, 0, heads * span, span, weight, 1e-6)
    assert torch.equal(got, want)


def test_refusals(kernels):
    gate_up, down = moe_of(kernels, 3, 256, 256, ["q8_0"] * 6, 1)
    with pytest.raises(ValueError, match="one gated MLP"):
        PackedMoe(gate_up, gate_up, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        PackedMoe(gate_up, down, 4, True)
    moe = PackedMoe(gate_up, down, 2, True)
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="int64 and float32"):
        moe(x, torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3))
    with pytest.raises(ValueError):
        moe(x, torch.tensor([[0, 3], [1, 2]]), torch.ones(2, 2))  # expert 3 of 3
    with pytest.raises(ValueError):
        kernels.moe_route(x, torch.randn(3, 256), 4, True)
    with pytest.raises(ValueError, match="runs"):
        kernels.head_norms(torch.randn(2, 10), 4, 8, 3, torch.ones(3), 1e-6)
