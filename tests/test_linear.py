"""Prepacked linear layers give `F.linear`'s result at every batch size, and fall back cleanly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from numerics import gamma, steps

from ferrox_batch.models.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear_at_every_batch_size(dtype, with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    layer = Linear(weight, bias)
    # bf16 is packed where oneDNN's op exists; fp32 always runs plain (see the module docstring).
    assert layer.kind in (("mkldnn", "plain") if dtype == torch.bfloat16 else ("plain",))
    for batch in (1, 3, 32, 33, 257):
        x = torch.randn(batch, 40, generator=gen).to(dtype)
        assert_same_linear(layer(x), x, weight, bias)
    strided = torch.randn(8, 80, generator=gen).to(dtype)[:, :40]
    assert_same_linear(layer(strided), strided, weight, bias)


def assert_same_linear(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    want = F.linear(x, weight, bias)
    if got.dtype == torch.float32:
        assert torch.equal(got, want)  # fp32 runs F.linear itself
        return
    # bf16: both sides sum the 40 products in float32, in their own order (gamma_41 of the magnitudes,
    # the bias included, each), then round to bf16, at most twice (once more if the bias is added after).
    magnitudes = x.float().abs() @ weight.float().abs().T + (0 if bias is None else bias.float().abs())
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    bound = 2 * gamma(41) * magnitudes.double() + steps(2, exact, torch.bfloat16) + steps(2, want.float(), torch.bfloat16)
    assert bool(((got.double() - want.double()).abs() <= bound).all())


def test_packing_can_be_turned_off():
    layer = Linear(torch.randn(4, 4), pack=False)
    assert layer.kind == "plain"
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), F.linear(x, layer.weight))
