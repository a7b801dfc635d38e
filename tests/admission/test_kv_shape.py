"""KvElem byte widths and KvShape pricing: exact for real sizes, saturating for absurd ones."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.admission.kv import KvElem, KvShape
from ferrox_batch.checks import UNLIMITED
from ferrox_batch.runtime.config import ModelConfig


@dataclass
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int


def test_element_widths_match_upstream():
    assert KvElem.F32.bytes_for(10) == 40
    assert KvElem.F16.bytes_for(10) == 20
    for elem in KvElem:
        assert elem.bytes_for(0) == 0


def test_element_widths_saturate_instead_of_growing_past_the_word():
    for elem in (KvElem.F32, KvElem.F16):
        assert elem.bytes_for(UNLIMITED) == UNLIMITED
    assert KvElem.F16.bytes_for(UNLIMITED // 2) == UNLIMITED - 1
    assert KvElem.F16.bytes_for(UNLIMITED // 2 + 1) == UNLIMITED


def test_two_layers_one_head_of_four_in_f32_cost_64_bytes_per_token():
    shape = KvShape.from_config(Geometry(2, 1, 4), KvElem.F32)
    assert shape == KvShape(2, 8, KvElem.F32)
    assert shape.per_token_kv_bytes() == 64
    assert shape.kv_bytes_for_tokens(101) == 101 * 64
    assert shape.kv_bytes_for_tokens(0) == 0


def test_a_real_model_config_prices_every_layer_at_every_position_even_with_a_window():
    cfg = ModelConfig(
        architecture="MistralForCausalLM",
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        sliding_window=8,
    )
    assert KvShape.from_config(cfg, KvElem.F32).per_token_kv_bytes() == 64


def test_the_default_model_costs_what_the_performance_notes_say():
    shape = KvShape.from_config(Geometry(30, 3, 64), KvElem.F32)
    assert shape.per_token_kv_bytes() == 46_080
    assert KvShape.from_config(Geometry(30, 3, 64), KvElem.F16).per_token_kv_bytes() == 23_040


def test_a_huge_but_representable_token_count_reports_saturated_bytes():
    shape = KvShape(2, 8, KvElem.F32)
    assert shape.kv_bytes_for_tokens(10 + UNLIMITED // 64) == UNLIMITED
    assert shape.kv_bytes_for_tokens(UNLIMITED) == UNLIMITED


@settings(max_examples=200, deadline=None)
@given(
    layers=st.integers(1, 128),
    width=st.integers(1, 4096),
    elem=st.sampled_from(list(KvElem)),
    tokens=st.integers(0, UNLIMITED),
)
def test_pricing_is_exact_below_the_word_and_saturated_above_it(layers, width, elem, tokens):
    shape = KvShape(layers, width, elem)
    got = shape.kv_bytes_for_tokens(tokens)
    elems = width * tokens
    per_layer = elems * (4 if elem is KvElem.F32 else 2)
    exact = layers * per_layer
    if elems <= UNLIMITED and exact <= UNLIMITED:
        assert got == exact
    else:
        assert got == UNLIMITED or got >= min(exact, UNLIMITED) // 2
    assert 0 <= got <= UNLIMITED


@settings(max_examples=100, deadline=None)
@given(a=st.integers(0, 10**12), b=st.integers(0, 10**12), elem=st.sampled_from(list(KvElem)))
def test_more_tokens_never_cost_fewer_bytes(a, b, elem):
    shape = KvShape(4, 96, elem)
    lo, hi = sorted((a, b))
    assert shape.kv_bytes_for_tokens(lo) <= shape.kv_bytes_for_tokens(hi)


@pytest.mark.parametrize(
    ("args", "error", "name"),
    [
        ((0, 8, KvElem.F32), ValueError, "n_layers"),
        ((2, 0, KvElem.F32), ValueError, "elems_per_token_per_layer"),
        ((2.0, 8, KvElem.F32), TypeError, "n_layers"),
        ((2, True, KvElem.F32), TypeError, "elems_per_token_per_layer"),
        ((2, 8, "f32"), TypeError, "elem"),
    ],
)
def test_a_shape_refuses_a_bad_geometry_by_name(args, error, name):
    with pytest.raises(error, match=name):
        KvShape(*args)


def test_pricing_refuses_bad_counts_by_name():
    shape = KvShape(2, 8, KvElem.F32)
    with pytest.raises(ValueError, match="tokens"):
        shape.kv_bytes_for_tokens(-1)
    with pytest.raises(TypeError, match="tokens"):
        shape.kv_bytes_for_tokens(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="elems"):
        KvElem.F16.bytes_for(True)
    with pytest.raises(ValueError, match="num_kv_heads"):
        KvShape.from_config(Geometry(2, 0, 4), KvElem.F32)
    with pytest.raises(TypeError, match="num_layers"):
        KvShape.from_config(object(), KvElem.F32)  # type: ignore[arg-type]
