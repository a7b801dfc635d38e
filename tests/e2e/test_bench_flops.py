"""The FLOP count of a workload, checked against hand counts and its own additivity; the GEMM peak's kinds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.bench.flops import gemm_peak, linear_params, workload_flops
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels

TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4, intermediate_size=6,
                   num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2)


def test_linear_params_are_the_layers_weights():
    # q 4x4, k and v 4x2 each, o 4x4, gate/up/down 4x6 each: 16 + 16 + 16 + 72 = 120 a layer.
    assert linear_params(TINY) == 2 * 120


def test_one_request_by_hand():
    # 3 prompt tokens, 2 new: fed 4 tokens (the last new one is never fed), 2 lm-head rows; the fed
    # tokens attend to 1, 2, 3 and 4 positions: 10 positions, 4 * heads * head_dim * layers = 32 each.
    assert workload_flops(TINY, [(3, 2)]) == 4 * 2 * 240 + 2 * 2 * 10 * 4 + 32 * 10


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 64)), max_size=8))
def test_requests_add_up_and_longer_work_costs_more(requests):
    assert workload_flops(TINY, requests) == sum(workload_flops(TINY, [r]) for r in requests)
    for prompt, new in requests:
        assert workload_flops(TINY, [(prompt + 1, new)]) > workload_flops(TINY, [(prompt, new)])
        assert workload_flops(TINY, [(prompt, new + 1)]) > workload_flops(TINY, [(prompt, new)])


def test_the_gemm_peak_is_measured_for_each_kind_this_torch_has():
    import torch

    peak = gemm_peak(size=128, repeats=2)
    assert peak.fp32 > 0
    assert (peak.fp16_weights is not None) == ("fbgemm" in torch.backends.quantized.supported_engines)
    kernels = cpu_kernels()
    assert (peak.fp16_panels is not None) == (kernels is not None and kernels.f16_gemm_vectorised)
    assert peak.best == max(peak.fp32, peak.fp16_weights or 0.0, peak.fp16_panels or 0.0)
