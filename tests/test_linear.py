"""Prepacked linear layers give `F.linear`'s result at every batch size, and fall back cleanly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(layer(x).float(), F.linear(x, weight, bias).float(), atol=tol, rtol=tol)
    strided = torch.randn(8, 80, generator=gen).to(dtype)[:, :40]
    assert torch.allclose(layer(strided).float(), F.linear(strided, weight, bias).float(), atol=2e-2, rtol=2e-2)


def test_packing_can_be_turned_off():
    layer = Linear(torch.randn(4, 4), pack=False)
    assert layer.kind == "plain"
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), F.linear(x, layer.weight))
