"""`auto` picks the dtype (and what the KV cache stores) from what the CPU reports, the same on every start,
and says why."""

from __future__ import annotations

import logging

import pytest
import torch

from ferrox_batch.runtime import device as device_module
from ferrox_batch.runtime.architectures.linear import FP16_KINDS, preferred_fp16_kind
from ferrox_batch.runtime.device import (
    BF16_CLEAR_LEAD,
    KV_CACHE_DTYPES,
    CpuFeatures,
    DtypeChoice,
    choose_dtype,
    choose_dtype_reasoned,
    choose_kv_dtype,
    cpu_description,
    cpu_dtype_from_features,
)
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels
from ferrox_batch.runtime.loading.loader import load_model

CPU = torch.device("cpu")
AVX2_ONLY = CpuFeatures("x86_64", avx512_bf16=False, amx=False)
AVX2_FBGEMM = CpuFeatures("x86_64", avx512_bf16=False, amx=False, fbgemm=True)
AVX512_BF16_FBGEMM = CpuFeatures("x86_64", avx512_bf16=True, amx=False, fbgemm=True)
AVX512_BF16 = CpuFeatures("x86_64", avx512_bf16=True, amx=False)
AMX = CpuFeatures("x86_64", avx512_bf16=False, amx=True)
ARM = CpuFeatures("aarch64", avx512_bf16=False, amx=False)


def _no_timing(*args, **kwargs):
    raise AssertionError("a CPU that reports its bf16 support must not be timed")


@pytest.mark.parametrize("features, want", [(AVX2_ONLY, torch.float32), (AVX512_BF16, torch.bfloat16),
                                            (AMX, torch.bfloat16)])
def test_an_x86_cpu_decides_from_its_flags_without_timing(monkeypatch, features, want):
    monkeypatch.setattr(device_module, "bf16_speedup", _no_timing)
    choice = choose_dtype_reasoned("auto", CPU, features=features)
    assert choice.dtype == want
    assert ("has native bf16" in choice.reason) == (want == torch.bfloat16)
    assert cpu_dtype_from_features(features) is not None


def test_a_timing_that_would_favour_bf16_cannot_override_an_avx2_only_cpu(monkeypatch):
    monkeypatch.setattr(device_module, "bf16_speedup", lambda *a, **k: 10.0)
    assert choose_dtype_reasoned("auto", CPU, features=AVX2_ONLY).dtype == torch.float32


@pytest.mark.parametrize("speedup, want", [(BF16_CLEAR_LEAD * 1.01, torch.bfloat16),
                                           (BF16_CLEAR_LEAD * 0.99, torch.float32), (0.3, torch.float32)])
def test_an_unknown_cpu_is_timed_and_bf16_needs_a_clear_lead(monkeypatch, speedup, want):
    monkeypatch.setattr(device_module, "bf16_speedup", lambda *a, **k: speedup)
    choice = choose_dtype_reasoned("auto", CPU, features=ARM)
    assert choice.dtype == want
    assert f"{speedup:.2f}x" in choice.reason


def test_named_dtypes_and_cuda_need_no_probe(monkeypatch):
    monkeypatch.setattr(device_module.CpuFeatures, "probe", classmethod(lambda cls: _no_timing()))
    assert choose_dtype("fp32", CPU) == torch.float32
    assert choose_dtype(torch.float16, CPU) == torch.float16
    assert choose_dtype_reasoned("auto", torch.device("cuda")).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        choose_dtype("float8", CPU)


def test_the_running_cpu_gives_the_same_answer_every_time():
    # Whatever this machine is, `auto` is a function of its flags: repeated choices agree.
    choices = {choose_dtype_reasoned("auto", CPU).name for _ in range(5)}
    assert len(choices) == 1
    features = CpuFeatures.probe()
    if features.x86:
        assert choices == {"bf16" if features.native_bf16 else "fp16w" if features.fbgemm else "fp32"}


def test_without_native_bf16_fp16_weights_are_picked_where_fbgemm_runs(monkeypatch):
    monkeypatch.setattr(device_module, "bf16_speedup", _no_timing)
    choice = choose_dtype_reasoned("auto", CPU, features=AVX2_FBGEMM)
    assert (choice.dtype, choice.weights, choice.name) == (torch.float32, "fp16", "fp16w")
    assert "fp16 weights" in choice.reason
    native = choose_dtype_reasoned("auto", CPU, features=AVX512_BF16_FBGEMM)
    assert (native.dtype, native.weights, native.name) == (torch.bfloat16, "dtype", "bf16")
    plain = choose_dtype_reasoned("auto", CPU, features=AVX2_ONLY)
    assert (plain.weights, plain.name) == ("dtype", "fp32")


def test_fp16_weights_can_be_asked_for_on_the_cpu_only():
    asked = choose_dtype_reasoned("fp16w", CPU)
    assert (asked.dtype, asked.weights, asked.reason) == (torch.float32, "fp16", "asked for")
    with pytest.raises(ValueError, match="CPU precision"):
        choose_dtype_reasoned("fp16w", torch.device("cuda"))


def test_the_loader_logs_the_choice_and_keeps_its_reason(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="ferrox_batch.runtime.loading"):
        model = load_model(tiny_llama_dir, device="cpu", dtype="auto")
    assert model.dtype_reason.startswith("auto")
    assert any(model.dtype_reason in record.getMessage() for record in caplog.records)
    assert load_model(tiny_llama_dir, device="cpu", dtype="fp32").dtype_reason == "asked for"


CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse avx2 fma avx512f avx512_bf16 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse avx2 fma avx512f avx512_bf16 sha_ni
"""


def test_the_cpu_description_names_the_model_and_the_flags_that_matter():
    assert cpu_description(CPUINFO) == "AMD EPYC 7B13; flags: avx2 fma avx512f avx512_bf16"
    assert "flags: none of" in cpu_description("model name : Something\nflags : sse\n")
    assert cpu_description()  # the running machine's, whatever it is


def test_fp16_weights_that_cannot_load_are_named_for_what_runs(tiny_llama_dir, monkeypatch, caplog):
    def missing(*args, **kwargs):
        raise RuntimeError("no fbgemm here")

    monkeypatch.setattr(torch.ops.quantized, "linear_prepack_fp16", missing, raising=False)
    if cpu_kernels() is not None:  # and our kernel, as where it was built without AVX2, FMA and F16C
        monkeypatch.setattr(cpu_kernels(), "f16_gemm_vectorised", False)
    with caplog.at_level(logging.WARNING, logger="ferrox_batch.runtime.loading"):
        model = load_model(tiny_llama_dir, device="cpu", dtype="fp16w")
    assert not set(FP16_KINDS) & set(model.decoder.linear_kinds)
    assert model.precision == "fp32" and "no fp16-weight linear kernel" in model.dtype_reason
    assert model.decoder.kv_dtype == torch.float32  # auto's K/V follow what runs: plain fp32
    assert any("fp16 weights were asked for" in r.getMessage() for r in caplog.records)


def test_fp16_weights_load_as_asked_where_fbgemm_runs(tiny_llama_dir):
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no fbgemm")
    model = load_model(tiny_llama_dir, device="cpu", dtype="fp16w")
    assert model.precision == "fp16w" and set(model.decoder.linear_kinds) == {preferred_fp16_kind(cpu_kernels())}


FP16W = DtypeChoice(torch.float32, "asked for", "fp16")
FP32 = DtypeChoice(torch.float32, "asked for")
BF16 = DtypeChoice(torch.bfloat16, "asked for")


@pytest.mark.parametrize("precision, device, in_place, want", [
    (FP16W, CPU, True, torch.float16),     # 16-bit storage, fp32 arithmetic: the in-place kernel widens it
    (FP16W, CPU, False, torch.float32),    # the torch path would gather and widen a copy every layer
    (FP32, CPU, True, torch.float32),      # plain fp32 stays fp32 throughout
    (BF16, CPU, True, torch.bfloat16),
    (BF16, torch.device("cuda"), False, torch.bfloat16),
])
def test_auto_stores_fp16_kv_only_under_fp16_weights_with_the_in_place_kernel(precision, device, in_place, want):
    chosen = choose_kv_dtype("auto", precision, device, in_place)
    assert chosen.dtype == want and chosen.reason.startswith("auto")
    assert choose_kv_dtype(None, precision, device, in_place).dtype == want


def test_a_named_kv_dtype_is_taken_as_asked_and_a_bad_one_is_refused():
    for name, dtype in KV_CACHE_DTYPES.items():
        for asked in (name, dtype):
            chosen = choose_kv_dtype(asked, FP32, CPU, True)
            assert (chosen.dtype, chosen.reason, chosen.name) == (dtype, "asked for", name)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int8'; use one of auto, fp32, fp16, bf16"):
        choose_kv_dtype("int8", FP32, CPU, True)
    with pytest.raises(ValueError, match="a KV cache holds one of fp32, fp16, bf16"):
        choose_kv_dtype(torch.int8, FP32, CPU, True)


def test_the_loader_stores_kv_as_chosen_and_prices_positions_with_it(tiny_llama_dir):
    fp32 = load_model(tiny_llama_dir, device="cpu", dtype="fp32")
    half = load_model(tiny_llama_dir, device="cpu", dtype="fp32", kv_cache_dtype="fp16")
    assert (fp32.decoder.kv_dtype, fp32.kv_dtype_name) == (torch.float32, "fp32")
    assert (half.decoder.kv_dtype, half.kv_dtype_name, half.kv_dtype_reason) == (torch.float16, "fp16", "asked for")
    assert half.decoder.new_store(4, num_blocks=2).kv.dtype == torch.float16
    assert 2 * half.kv_shape().per_token_kv_bytes() == fp32.kv_shape().per_token_kv_bytes()
    on_cpu = load_model(tiny_llama_dir, device="cpu", dtype="fp16w")
    want = torch.float16 if on_cpu.decoder.kernels is not None else torch.float32
    assert on_cpu.decoder.kv_dtype == want and on_cpu.kv_dtype_reason.startswith("auto")
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        load_model(tiny_llama_dir, device="cpu", kv_cache_dtype="fp8")
