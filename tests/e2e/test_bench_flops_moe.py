"""A mixture of experts' FLOP count: each token through the router and the k experts it chooses (and the shared
expert), never `intermediate_size`, which gpt-oss uses for the experts' width and Qwen3-MoE for an unused one."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.bench.flops import linear_params
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.families.moe_config import MoeShape

DENSE = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4, intermediate_size=6,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2)
ATTENTION = 16 + 8 + 8 + 16  # q 4x4, k and v 4x2 each, o 4x4


def test_a_sparse_layer_by_hand() -> None:
    # layer 0 sparse: router 4x8, two chosen experts of width 3 (gate/up/down 4x3 each), a shared one of width 5;
    # layer 1 dense: gate/up/down 4x6 each
    moe = MoeShape(experts=8, top_k=2, intermediate=3, renormalize=True, sparse_layers=(True, False),
                   shared_intermediate=5)
    config = replace(DENSE, moe=moe)
    assert linear_params(config) == (ATTENTION + 32 + 3 * 4 * (2 * 3 + 5)) + (ATTENTION + 72)


@settings(max_examples=50, deadline=None)
@given(experts=st.integers(1, 64), data=st.data(), width=st.integers(1, 64))
def test_the_chosen_experts_count_and_the_rest_do_not(experts: int, data: st.DataObject, width: int) -> None:
    top_k = data.draw(st.integers(1, experts))
    config = replace(DENSE, moe=MoeShape(experts=experts, top_k=top_k, intermediate=width, renormalize=True,
                                         sparse_layers=(True, True)))
    per_layer = ATTENTION + 4 * experts + 3 * 4 * top_k * width
    assert linear_params(config) == 2 * per_layer
    # the dense width is not read on a sparse layer
    assert linear_params(replace(config, intermediate_size=1000)) == linear_params(config)
