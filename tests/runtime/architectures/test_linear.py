"""Prepacked linear layers give `F.linear`'s result at every batch size, and fall back cleanly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_same_linear

from ferrox_batch.runtime.architectures.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear_at_every_batch_size(dtype, with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    layer = Linear(weight, bias)
    # Packed where oneDNN's op exists (torch's x86-64 CPU wheels have it), plain otherwise.
    assert layer.kind in ("mkldnn", "plain")
    for batch in (1, 3, 32, 33, 257):
        x = torch.randn(batch, 40, generator=gen).to(dtype)
        assert_same_linear(layer(x), x, weight, bias)
    strided = torch.randn(8, 80, generator=gen).to(dtype)[:, :40]
    assert_same_linear(layer(strided), strided, weight, bias)


def test_fp32_cpu_weights_are_packed_where_onednn_is_built():
    # The fast path must not silently fall back on the machines we ship for: torch's x86-64 CPU wheels
    # have oneDNN, so a plain fp32 layer there means the probe or the op broke.
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    assert Linear(torch.randn(64, 48)).kind == "mkldnn"


def test_loading_a_layer_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    Linear(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(torch.rand(4), want)


def test_packing_can_be_turned_off():
    layer = Linear(torch.randn(4, 4), pack=False)
    assert layer.kind == "plain"
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines


@pytest.mark.parametrize("with_bias", [False, True])
def test_fp16_weights_give_f_linear_of_the_rounded_weight(with_bias):
    # fbgemm widens the fp16 weight to fp32 and accumulates in fp32: the result is F.linear over the
    # weight rounded to fp16, up to the two summation orders (the fp32 bound above); a fallback layer
    # runs the unrounded weight, exactly the fp32 bound against F.linear.
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    layer = Linear(weight, bias, weights="fp16")
    assert layer.kind == ("fbgemm_fp16" if FBGEMM else "mkldnn" if torch.backends.mkldnn.is_available() else "plain")
    assert (layer.weight is None) == (layer.kind != "plain")  # a packed layer keeps no fp32 copy
    used = weight.half().float() if layer.kind == "fbgemm_fp16" else weight
    for batch in (1, 3, 32, 33, 257):
        x = torch.randn(batch, 40, generator=gen)
        assert_same_linear(layer(x), x, used, bias)
    strided = torch.randn(8, 80, generator=gen)[:, :40]
    assert_same_linear(layer(strided), strided, used, bias)
    assert layer(torch.randn(0, 40)).shape == (0, 96)


def test_fp16_weights_are_for_fp32_models_and_fall_back_without_fbgemm(monkeypatch):
    # A bf16 weight keeps the bf16 path (the format names fp32 models' weights only).
    assert Linear(torch.randn(8, 8).bfloat16(), weights="fp16").kind in ("mkldnn", "plain")
    with pytest.raises(ValueError, match="unknown weight format"):
        Linear(torch.randn(8, 8), weights="int4")

    def missing(*args, **kwargs):
        raise RuntimeError("no fbgemm here")

    monkeypatch.setattr(torch.ops.quantized, "linear_prepack_fp16", missing, raising=False)
    weight = torch.randn(16, 8)
    layer = Linear(weight, weights="fp16")
    assert layer.kind in ("mkldnn", "plain")
    x = torch.randn(3, 8)
    assert_same_linear(layer(x), x, weight, None)


def test_a_tied_fp16_layer_keeps_the_shared_tensor():
    weight = torch.randn(32, 16)
    layer = Linear(weight, keep_weight=True, weights="fp16")
    assert layer.weight is weight


def test_a_weight_past_fp16s_range_stays_fp32_and_untouched():
    weight = torch.randn(16, 8)
    weight[3, 2] = 1e5
    kept = weight.clone()
    layer = Linear(weight, keep_weight=True, weights="fp16")
    assert layer.kind in ("mkldnn", "plain")
    assert torch.equal(weight, kept)  # nothing clamped the caller's tensor
    x = torch.randn(2, 8)
    assert_same_linear(layer(x), x, kept, None)


def test_packing_fp16_leaves_a_shared_weight_as_it_was():
    weight = torch.randn(32, 16)
    kept = weight.clone()
    Linear(weight, keep_weight=True, weights="fp16")
    assert torch.equal(weight, kept)
