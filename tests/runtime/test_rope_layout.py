"""`rope_layout`: every RoPE setting read from either layout, and what cannot be honoured refused by name."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.rope_layout import rope_settings

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}


def config(family: str = "llama", **fields: Any) -> dict[str, Any]:
    """A small config of `family` with `fields` added."""
    return {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, **fields}


def refused(raw: dict[str, Any], *names: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(raw)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("where", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("kind", ["proportional", "mrope", "rope_2d", "ntk-by-parts"])
def test_a_variant_this_runtime_does_not_compute_is_refused_by_name(where: str, kind: str) -> None:
    refused(config(**{where: {"rope_type": kind, "factor": 2.0}}), f"{where}.rope_type", repr(kind))
    refused(config("gemma3_text", rope_parameters={"full_attention": {"rope_type": kind, "factor": 2.0}}),
            "rope_parameters.full_attention.rope_type", repr(kind))


@pytest.mark.parametrize("params, key", [
    ({"rope_type": "linear", "factor": 2.0, "finetuned": True}, "finetuned"),
    ({"rope_type": "default", "factor": 4.0}, "factor"),  # plain RoPE would drop the factor
    ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 256},
     "original_max_position_embeddings"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64, "beta_fast": 32}, "beta_fast"),
    ({"rope_type": "default", "rope_theta": 5e5, "mrope_section": [8, 8]}, "mrope_section"),
])
def test_a_key_the_variant_does_not_read_is_refused_by_name(params: dict[str, Any], key: str) -> None:
    for where in ("rope_parameters", "rope_scaling"):
        refused(config(**{where: params}), where, repr(key))


def test_llama3_scaling_needs_both_frequency_factors() -> None:
    refused(config(rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}), "low_freq_factor")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "smollm3", "gemma3_text"])
def test_partial_rotation_outside_phi3_is_refused_not_dropped(family: str) -> None:
    refused(config(family, partial_rotary_factor=0.5), "partial_rotary_factor")
    where = "rope_parameters.full_attention" if family == "gemma3_text" else "rope_parameters"
    params = {"rope_type": "default", "partial_rotary_factor": 0.5}
    refused(config(family, rope_parameters={"full_attention": params} if family == "gemma3_text" else params),
            f"{where}.partial_rotary_factor")
    # The whole head, said out loud, is what every layer does anyway.
    assert ModelConfig.from_dict(config(family, partial_rotary_factor=1.0)).rotary_dim == 16


def test_gemma3_refuses_a_flat_rope_dict_and_scaled_local_layers() -> None:
    refused(config("gemma3_text", rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
            "'rope_theta'", "full_attention", "sliding_attention")
    refused(config("gemma3_text", rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
            "rope_parameters.sliding_attention.rope_type", "local layers")


@pytest.mark.parametrize("raw, names", [
    (config(rope_theta=10_000.0, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
     ("rope_parameters.rope_theta", "rope_theta", "500000.0", "10000.0")),
    (config(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_parameters={"rope_type": "default"}),
     ("rope_scaling", "rope_parameters")),
    (config("phi3", partial_rotary_factor=0.75, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     ("rope_parameters.partial_rotary_factor", "0.75")),
    (config(original_max_position_embeddings=128, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), ("rope_scaling.original_max_position_embeddings", "128", "64")),
    # Phi-3's reference takes 4096 where the top-level field is absent, whatever the dict says.
    (config("phi3", rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                  "original_max_position_embeddings": 40}), ("40", "4096")),
    (config("gemma3_text", rope_local_base_freq=10_000.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0}}),
     ("rope_parameters.sliding_attention.rope_theta", "rope_local_base_freq")),
    (config("gemma3_text", rope_scaling={"rope_type": "linear", "factor": 8.0},
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0}}),
     ("rope_scaling.factor", "rope_parameters.full_attention.factor")),
])
def test_two_places_that_disagree_are_refused_naming_both(raw: dict[str, Any], names: tuple[str, ...]) -> None:
    refused(raw, *names)


@pytest.mark.parametrize("theta", [0.0, 1.0, -5.0, float("nan"), float("inf"), "big"])
def test_a_base_that_is_not_a_number_above_one_is_refused(theta: Any) -> None:
    with pytest.raises(ModelLoadError):
        ModelConfig.from_dict(config(rope_parameters={"rope_type": "default", "rope_theta": theta}))


def test_an_odd_rotated_width_is_refused() -> None:
    # 18 * 0.5 = 9 dimensions: the reference rotates an odd width with frequencies no even table holds.
    refused(config("phi3", head_dim=18, partial_rotary_factor=0.5), "partial_rotary_factor")


def test_what_changes_nothing_is_read_without_complaint() -> None:
    for raw in (config(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0}),
                config(rope_scaling=None, rope_parameters=None, rope_theta=10_000.0),
                config(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, rope_theta=10_000.0),
                config(rope_scaling={"type": "linear", "rope_type": "linear", "factor": 2.0, "mscale": None})):
        ModelConfig.from_dict(raw)


def _tf_config(family: str, **kwargs: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers.AutoConfig.for_model(family, vocab_size=64, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=512, **kwargs)


SCALINGS = st.one_of(
    st.none(),
    st.builds(lambda f: {"type": "linear", "factor": f}, st.floats(1.0, 16.0)),
    st.builds(lambda f: {"rope_type": "dynamic", "factor": f}, st.floats(1.0, 16.0)),
    st.builds(lambda f, lo, hi, o: {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                                    "high_freq_factor": lo + hi, "original_max_position_embeddings": o},
              st.floats(1.0, 16.0), st.floats(0.5, 2.0), st.floats(0.5, 8.0), st.integers(16, 256)),
    st.builds(lambda f, o, b: {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": o,
                               "beta_fast": b}, st.floats(1.0, 16.0), st.integers(16, 256), st.floats(8.0, 64.0)),
)


@given(family=st.sampled_from(["llama", "qwen2", "mistral", "qwen3", "smollm3"]),
       theta=st.one_of(st.none(), st.floats(2.0, 1e7)), scaling=SCALINGS)
def test_both_layouts_read_as_transformers_reads_them(family: str, theta: float | None,
                                                      scaling: dict[str, Any] | None) -> None:
    old = config(family, **({} if theta is None else {"rope_theta": theta}),
                 **({} if scaling is None else {"rope_scaling": dict(scaling)}))
    theirs = _tf_config(family, **{k: v for k, v in old.items() if k.startswith("rope")})
    new = {**config(family), "rope_parameters": theirs.to_dict()["rope_parameters"]}
    read_old, read_new = rope_settings(old, family, 512), rope_settings(new, family, 512)
    assert read_old == read_new
    assert read_old.theta == theirs.rope_parameters["rope_theta"]
    kind = theirs.rope_parameters["rope_type"]
    assert (read_old.scaling.kind if read_old.scaling else "default") == kind
    if read_old.scaling is not None and kind != "dynamic":
        assert read_old.scaling.factor == theirs.rope_parameters["factor"]
        assert read_old.scaling.original_max_position_embeddings == theirs.rope_parameters.get(
            "original_max_position_embeddings")


@given(local=st.one_of(st.none(), st.floats(2.0, 1e6)), glob=st.one_of(st.none(), st.floats(2.0, 1e7)),
       factor=st.one_of(st.none(), st.floats(1.0, 16.0)))
def test_gemma3_reads_each_layer_kinds_base_in_either_layout(local: float | None, glob: float | None,
                                                             factor: float | None) -> None:
    old = config("gemma3_text", **({} if glob is None else {"rope_theta": glob}),
                 **({} if local is None else {"rope_local_base_freq": local}),
                 **({} if factor is None else {"rope_scaling": {"rope_type": "linear", "factor": factor}}))
    theirs = _tf_config("gemma3_text", **{k: v for k, v in old.items() if k.startswith("rope")})
    new = {**config("gemma3_text"), "rope_parameters": theirs.to_dict()["rope_parameters"]}
    read_old, read_new = rope_settings(old, "gemma3_text", 512), rope_settings(new, "gemma3_text", 512)
    assert read_old == read_new
    assert read_old.theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert read_old.local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert (read_old.scaling.factor if read_old.scaling else None) == factor


@given(theta=st.one_of(st.none(), st.floats(2.0, 1e7)), partial=st.sampled_from([None, 0.5, 0.75, 1.0]),
       name=st.sampled_from([None, "longrope", "su"]), original=st.integers(16, 512),
       factors=st.lists(st.floats(1.0, 8.0), min_size=2, max_size=2))
def test_phi3_reads_as_transformers_reads_it(theta: float | None, partial: float | None, name: str | None,
                                            original: int, factors: list[float]) -> None:
    rotated = int(16 * (partial or 1.0)) // 2
    old = config("phi3", original_max_position_embeddings=original, **({} if theta is None else {"rope_theta": theta}),
                 **({} if partial is None else {"partial_rotary_factor": partial}),
                 **({} if name is None else {"rope_scaling": {"type": name, "short_factor": [factors[0]] * rotated,
                                                               "long_factor": [factors[1]] * rotated}}))
    theirs = _tf_config("phi3", **{k: v for k, v in old.items() if k.startswith(("rope", "partial", "original"))})
    new = {**config("phi3", original_max_position_embeddings=original),
           "rope_parameters": theirs.to_dict()["rope_parameters"]}
    read_old, read_new = rope_settings(old, "phi3", 512), rope_settings(new, "phi3", 512)
    assert read_old == read_new
    assert read_old.theta == theirs.rope_parameters["rope_theta"]
    assert read_old.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"]
    assert (read_old.scaling.kind if read_old.scaling else "default") == theirs.rope_parameters["rope_type"]
    if read_old.scaling is not None:
        assert read_old.scaling.original_max_position_embeddings == original
        assert list(read_old.scaling.short_factor) == theirs.rope_parameters["short_factor"]
