"""Reading a mixture-of-experts config: `read_moe`, `sparse_step_layers` and `ModelConfig.from_dict` for
every MoE family, on the fields their published configs carry (the tiny checkpoints' entries in
`tiny_families.CONFIGS`).

Which layers are sparse follows Qwen's rule (not in `mlp_only_layers`, and (i + 1) a multiple of
`decoder_sparse_step`) for any layers, step and list; both spellings of the expert count are read where a
family's configs use both; every bad value is a `ModelLoadError` naming its field; and a config whose MoE
fields are any JSON values at all either builds or is refused with a `ModelLoadError`, never another error.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_families import CONFIGS, FixtureArgs

from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.families.moe_config import MoeShape, positive_int, read_moe, sparse_step_layers
from ferrox_batch.runtime.families.moe_spec import MoeSpec

FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
            "granitemoe": "GraniteMoeForCausalLM", "mixtral": "MixtralForCausalLM"}
#: The fields the MoE families read, what the fuzz test mutates (and `num_hidden_layers`, which sizes
#: `sparse_layers`: the fuzz keeps it small, as the loader checks it against the checkpoint's layers first).
MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
              "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def config(model_type: str, layers: int = 4, **extra: Any) -> dict[str, Any]:
    """A tiny checkpoint's config.json of the family (the fields `tiny_checkpoint` writes), with `extra`."""
    raw: dict[str, Any] = {
        "architectures": [FAMILIES[model_type]], "model_type": model_type, "vocab_size": 384, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    args = FixtureArgs(layers, 16, None, None, None, None, None, None, 0)
    raw.update(CONFIGS[model_type](args))
    raw.update(extra)
    return raw


@pytest.mark.parametrize(("model_type", "extra", "want"), [
    ("qwen3_moe", {"mlp_only_layers": [1]}, MoeShape(8, 2, 48, True, (True, False, True, True))),
    ("qwen3_moe", {"decoder_sparse_step": 2}, MoeShape(8, 2, 48, True, (False, True, False, True))),
    ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3]},
     MoeShape(8, 3, 40, False, (False, True, False, False), shared_intermediate=72)),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, MoeShape(8, 3, 40, False, (True,) * 4)),
    ("olmoe", {}, MoeShape(8, 2, 128, False, (True,) * 4)),
    ("olmoe", {"norm_topk_prob": True}, MoeShape(8, 2, 128, True, (True,) * 4)),
    ("granitemoe", {}, MoeShape(6, 2, 128, True, (True,) * 4)),
    ("mixtral", {"norm_topk_prob": False}, MoeShape(8, 2, 128, True, (True,) * 4)),  # Mixtral always renormalises
])
def test_each_family_reads_its_shape(model_type: str, extra: dict[str, Any], want: MoeShape) -> None:
    got = ModelConfig.from_dict(config(model_type, **extra))
    assert got.moe == want
    layers = got.family_spec.layers(got)
    assert [isinstance(layer.ffn, MoeSpec) for layer in layers] == list(want.sparse_layers)
    for layer in layers:
        if isinstance(layer.ffn, MoeSpec):
            assert (layer.ffn.router.experts, layer.ffn.router.top_k) == (want.experts, want.top_k)
            assert layer.ffn.router.renormalize == want.renormalize and layer.ffn.intermediate == want.intermediate
            assert (layer.ffn.shared is not None) == (want.shared_intermediate is not None)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "olmoe"])
def test_both_spellings_of_the_expert_count_are_read(model_type: str) -> None:
    """transformers 5 writes Qwen's `num_experts` as `num_local_experts`; OLMoE's configs spell it either way."""
    older = config(model_type, num_experts=6)
    newer = {k: v for k, v in older.items() if k != "num_experts"} | {"num_local_experts": 6}
    assert ModelConfig.from_dict(older).moe.experts == ModelConfig.from_dict(newer).moe.experts == 6
    neither = {k: v for k, v in older.items() if k != "num_experts"}
    with pytest.raises(ModelLoadError, match="num_experts"):
        ModelConfig.from_dict(neither)


@pytest.mark.parametrize("model_type", ["granitemoe", "mixtral"])
def test_the_local_expert_count_is_required_where_it_is_the_only_spelling(model_type: str) -> None:
    raw = {k: v for k, v in config(model_type).items() if k != "num_local_experts"} | {"num_experts": 8}
    with pytest.raises(ModelLoadError, match="num_local_experts"):
        ModelConfig.from_dict(raw)


@settings(max_examples=200)
@given(layers=st.integers(1, 30), step=st.integers(1, 6), data=st.data())
def test_sparse_layers_follow_the_step_and_the_dense_list(layers: int, step: int, data: st.DataObject) -> None:
    dense = data.draw(st.lists(st.integers(0, layers - 1), max_size=layers))
    got = sparse_step_layers({"decoder_sparse_step": step, "mlp_only_layers": dense}, layers)
    assert got == tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    assert sparse_step_layers({"mlp_only_layers": tuple(dense)}, layers) == tuple(i not in dense for i in range(layers))
    assert sparse_step_layers({}, layers) == (True,) * layers


@pytest.mark.parametrize(("fields", "name"), [
    ({"mlp_only_layers": [0, 4]}, "mlp_only_layers"),
    ({"mlp_only_layers": [-1]}, "mlp_only_layers"),
    ({"mlp_only_layers": 2}, "mlp_only_layers"),
    ({"mlp_only_layers": "1,2"}, "mlp_only_layers"),
    ({"mlp_only_layers": [1.0]}, "mlp_only_layers"),
    ({"mlp_only_layers": [True]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"decoder_sparse_step": 1.5}, "decoder_sparse_step"),
    ({"decoder_sparse_step": True}, "decoder_sparse_step"),
])
def test_a_bad_dense_list_or_step_is_refused_by_name(fields: dict[str, Any], name: str) -> None:
    with pytest.raises(ModelLoadError, match=name):
        sparse_step_layers(fields, 4)
    with pytest.raises(ModelLoadError, match=name):
        ModelConfig.from_dict(config("qwen3_moe", **fields))


BAD_COUNTS = [0, -2, 2.5, True, False, "8", [8], math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("field", ["experts", "num_experts_per_tok", "intermediate"])
@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
def test_a_bad_count_is_refused_by_name(model_type: str, field: str, value: Any) -> None:
    """By `read_moe` itself (no other error may escape it) and by `from_dict`."""
    experts_key = "num_local_experts" if model_type in ("granitemoe", "mixtral") else "num_experts"
    key = {"experts": experts_key, "intermediate": "moe_intermediate_size" if "qwen" in model_type
           else "intermediate_size"}.get(field, field)
    raw = config(model_type, **{key: value})
    intermediate_key = "moe_intermediate_size" if "qwen" in model_type else "intermediate_size"
    with pytest.raises(ModelLoadError, match=key):
        read_moe(raw, experts_key=(experts_key,), intermediate_key=intermediate_key)
    # Every family's `intermediate_size` is read first as the dense MLP's width, by `int()`: a value that
    # does not convert is refused there, as a malformed field.
    with pytest.raises(ModelLoadError, match=key if key != "intermediate_size" else None):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_more_experts_per_token_than_experts_is_refused(model_type: str) -> None:
    with pytest.raises(ModelLoadError, match="num_experts_per_tok is 9"):
        ModelConfig.from_dict(config(model_type, num_experts_per_tok=9))
    assert ModelConfig.from_dict(config(model_type, num_experts_per_tok=6)).moe.top_k == 6  # k == experts is fine


@pytest.mark.parametrize(("fields", "name"), [
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"norm_topk_prob": 1}, "norm_topk_prob"),
    ({"shared_expert_intermediate_size": -3}, "shared_expert_intermediate_size"),
    ({"shared_expert_intermediate_size": 2.5}, "shared_expert_intermediate_size"),
])
def test_a_bad_switch_or_shared_width_is_refused_by_name(fields: dict[str, Any], name: str) -> None:
    with pytest.raises(ModelLoadError, match=name):
        ModelConfig.from_dict(config("qwen2_moe", **fields))


def test_positive_int_takes_whole_floats_and_a_default() -> None:
    assert positive_int({"k": 8.0}, "k") == 8 and isinstance(positive_int({"k": 8.0}, "k"), int)
    assert positive_int({}, "k", 3) == 3
    with pytest.raises(ModelLoadError, match="missing the field 'k'"):
        positive_int({"k": None}, "k")


#: Any JSON value, weighted toward the ones a config's counts and lists are made of.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.integers() | st.sampled_from([0.0, 2.0, 2.5, -1.0])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300)
@given(model_type=st.sampled_from(list(FAMILIES)),
       mutations=st.dictionaries(st.sampled_from(MOE_FIELDS), JSON | st.lists(st.integers(-2, 6), max_size=6),
                                 max_size=4),
       dropped=st.sets(st.sampled_from(MOE_FIELDS), max_size=2),
       layers=st.none() | st.integers(-1, 12) | st.sampled_from([2.0, 2.5, "3", True, [3]]))
def test_any_moe_fields_build_or_are_refused_as_a_load_error(model_type: str, mutations: dict[str, Any],
                                                              dropped: set[str], layers: Any) -> None:
    raw = {k: v for k, v in config(model_type).items() if k not in dropped} | mutations
    if layers is not None:
        raw["num_hidden_layers"] = layers
    try:
        got = ModelConfig.from_dict(raw)
        layers = got.family_spec.layers(got)
    except ModelLoadError:
        return
    moe = got.moe
    assert 0 < moe.top_k <= moe.experts and moe.intermediate > 0 and len(moe.sparse_layers) == got.num_layers
    assert [isinstance(layer.ffn, MoeSpec) for layer in layers] == list(moe.sparse_layers)
