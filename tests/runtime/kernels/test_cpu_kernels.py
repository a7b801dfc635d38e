"""The CPU kernels (paged decode attention, RMSNorm): against float64 references, inside the decoder, their build
(each flag set's build is also checked on the prefill-attention kernel, tested in test_prefill_attention_kernel)."""

from __future__ import annotations

import logging
import platform
import random
import threading
from pathlib import Path

import pytest
import torch
from attention_reference import (
    decode_error_bound,
    prefill_as_decode,
    prefill_case,
    random_case,
    reference,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_builds import BASELINE_FLAGS, built_kernels, needs_compiler
from numerics import (
    gamma,
    logits_tolerance,
    rounds_alike,
    steps,
    steps_apart,
    unit_roundoff,
)

from ferrox_batch.runtime.kernels import cpu_kernels as kernels_module
from ferrox_batch.runtime.kernels import kernel_build as build_module
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels, cpu_kernels
from ferrox_batch.runtime.kernels.openmp import loaded_openmp_runtimes
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan
from ferrox_batch.runtime.loading.loader import load_model

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return built_kernels()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    n=st.integers(1, 6),
    kv=st.integers(1, 3),
    g=st.integers(1, 7),  # the tiled path takes query heads 3 at a time: 1-3, then 3 + 1, 3 + 2, 3 + 3 + 1
    d=st.sampled_from([4, 16, 24, 40, 64]),  # the tiled path's values: 8 at a time, 32, 32 + 8
    block=st.sampled_from([1, 3, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 12)),
)
def test_float32_matches_the_reference(kernels, seed, n, kv, g, d, block, window) -> None:
    q, pool, tables, lo, hi = random_case(random.Random(seed), n, kv, g, d, block, window, torch.float32)
    got = kernels.paged_decode(q, pool, tables, lo, hi, block, d ** -0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    want = reference(q, pool, tables, lo, hi, block)
    assert bool(((got.double() - want).abs() <= decode_error_bound(q, pool, tables, lo, hi, block, d ** -0.5)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64])
def test_a_sequence_alone_gets_the_bits_it_gets_among_many(kernels, dtype, d) -> None:
    """Alone a sequence's KV heads are separate tasks (to fill the team); among many, one task takes them
    all: each head's sums are the same operations either way, so the results are equal bit for bit."""
    n = 2 * torch.get_num_threads() + 1  # enough sequences to fill the team without splitting them
    q, pool, tables, lo, hi = random_case(random.Random(d), n, 3, 3, d, 4, None, dtype)
    together = kernels.paged_decode(q, pool, tables, lo, hi, 4, d ** -0.5)
    for i in range(n):
        alone = kernels.paged_decode(q[i:i + 1], pool, tables[i:i + 1], lo[i:i + 1], hi[i:i + 1], 4, d ** -0.5)
        assert torch.equal(alone, together[i:i + 1])


@pytest.mark.parametrize("seed", range(8))
def test_bfloat16_matches_the_reference_to_bf16_rounding(kernels, seed) -> None:
    rng = random.Random(seed)
    q, pool, tables, lo, hi = random_case(rng, 5, 3, 3, 64, 16, None if seed % 2 else 9, torch.bfloat16)
    got = kernels.paged_decode(q, pool, tables, lo, hi, 16, 64 ** -0.5)
    want = reference(q, pool, tables, lo, hi, 16)
    assert got.dtype == torch.bfloat16
    # Accumulation is float32 (within `bound` of the exact value), then one rounding to bf16: within
    # half a bf16 step of the float32 result, and equal to the exact value's own rounding wherever that
    # lies farther than `bound` from a half-way point between two bf16 values.
    bound = decode_error_bound(q, pool, tables, lo, hi, 16, 64 ** -0.5)
    assert bool(((got.double() - want).abs() <= bound + steps(0.5, want.abs() + bound, torch.bfloat16)).all())
    alike = rounds_alike(want, bound, torch.bfloat16)
    assert torch.equal(got[alike], want.to(torch.bfloat16)[alike])
    # Not vacuous: the bound is a few hundredths of a bf16 step at most values (an average of random
    # values cancels, so it is larger next to the smallest), and a value lies within it of a half-way
    # point only about twice that often.
    assert alike.double().mean() > 0.5


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    pool_dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    d=st.sampled_from([4, 24, 64]),  # 4 takes the one-slot-at-a-time path, the others the tiled one on AVX2
    tiny=st.booleans(),
)
def test_a_narrower_pool_is_widened_exactly(kernels, seed, pool_dtype, d, tiny) -> None:
    """A KV cache stored in fp16 or bf16 under float32 queries: the result is the float32 one over the
    pool's values widened, within the same bound (widening is exact; fp16 subnormals included)."""
    q, pool, tables, lo, hi = random_case(random.Random(seed), 4, 3, 3, d, 16, None, torch.float32)
    narrow = (pool * (1e-5 if tiny else 1.0)).to(pool_dtype)
    if tiny and pool_dtype == torch.float16:
        assert bool(((narrow != 0) & (narrow.abs() < torch.finfo(torch.float16).tiny)).any())  # subnormals
    got = kernels.paged_decode(q, narrow, tables, lo, hi, 16, d ** -0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    wide = narrow.float()
    want = reference(q, wide, tables, lo, hi, 16)
    assert bool(((got.double() - want).abs() <= decode_error_bound(q, wide, tables, lo, hi, 16, d ** -0.5)).all())


def test_the_scale_is_applied(kernels) -> None:
    q, pool, tables, lo, hi = random_case(random.Random(1), 3, 2, 2, 16, 4, None, torch.float32)
    flat = kernels.paged_decode(q, pool, tables, lo, hi, 4, 0.0)  # zero scale: a plain mean of the values
    bound = decode_error_bound(q, pool, tables, lo, hi, 4, 0.0)
    for i in range(3):
        pos = torch.arange(int(hi[i]))
        values = pool.double()[tables[i, pos // 4] * 4 + pos % 4][:, 1]  # [L, kv, d]
        mean = values.mean(0)[:, None, :].expand(2, 2, 16)
        assert bool(((flat[i].double() - mean).abs() <= bound[i]).all())
    # And with the scale the same queries weigh the values unevenly, as the reference does.
    scaled = kernels.paged_decode(q, pool, tables, lo, hi, 4, 0.25)
    assert bool(((scaled.double() - reference(q, pool, tables, lo, hi, 4, 0.25)).abs()
                 <= decode_error_bound(q, pool, tables, lo, hi, 4, 0.25)).all())
    assert not torch.equal(scaled, flat)


def test_bad_inputs_are_clear_errors(kernels) -> None:
    q, pool, tables, lo, hi = random_case(random.Random(2), 2, 2, 2, 8, 4, None, torch.float32)
    with pytest.raises(ValueError, match="a pool in one of"):
        kernels.paged_decode(q, pool.double(), tables, lo, hi, 4, 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.paged_decode(q.double(), pool, tables, lo, hi, 4, 1.0)
    with pytest.raises(ValueError, match="expected"):
        kernels.paged_decode(q, pool[:, :1], tables, lo, hi, 4, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_decode(q, pool, tables.int(), lo, hi, 4, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        kernels.paged_decode(q, pool, tables[:1], lo, hi, 4, 1.0)
    # The pool is read through raw pointers: anything out of range is refused before the call.
    width = tables.shape[1] * 4
    with pytest.raises(ValueError, match="outside its block table"):
        kernels.paged_decode(q, pool, tables, lo, torch.full_like(hi, width + 1), 4, 1.0)
    with pytest.raises(ValueError, match="outside its block table"):
        kernels.paged_decode(q, pool, tables, lo - 1, hi, 4, 1.0)
    with pytest.raises(ValueError, match="outside its block table"):
        kernels.paged_decode(q, pool, tables, hi, lo, 4, 1.0)
    with pytest.raises(ValueError, match="outside the KV pool"):
        kernels.paged_decode(q, pool, tables + pool.shape[0], lo, hi, 4, 1.0)
    with pytest.raises(ValueError, match="whole blocks"):
        kernels.paged_decode(q, pool[:-1], tables, lo, hi, 4, 1.0)


def test_a_non_contiguous_query_is_read_correctly(kernels) -> None:
    q, pool, tables, lo, hi = random_case(random.Random(3), 4, 2, 3, 16, 4, None, torch.float32)
    wide = torch.cat([q, torch.full_like(q, 1e6)], dim=-1)[..., :16]  # a strided view of q
    # The same values in the same order: the same bits.
    assert torch.equal(kernels.paged_decode(wide, pool, tables, lo, hi, 4, 0.25), kernels.paged_decode(q, pool, tables, lo, hi, 4, 0.25))


def test_loading_it_adds_no_second_openmp_runtime_and_keeps_denormals(kernels) -> None:
    # Every OpenMP runtime mapped into the process, of any vendor: only torch's may be there.
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if line.split()[-1].startswith("/") and Path(line.split()[-1]).name.startswith(("libgomp", "libomp", "libiomp"))}
    assert len(mapped) == 1 and loaded_openmp_runtimes() == sorted(mapped), mapped
    assert Path(next(iter(mapped))).parent == Path(torch.__file__).parent / "lib", mapped
    # Linking with -ffast-math would switch on flush-to-zero process-wide.
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float(tiny * 1.0) != 0.0


def reference_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama reference: float32 statistics, cast back, then the weight in the input dtype."""
    return weight * reference_normed(h, eps).to(h.dtype)


def reference_normed(h: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's float32 `x * rsqrt(mean(x^2) + eps)`, before the cast back."""
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


#: The kernel's `1.0f / sqrtf(v)`: under -ffast-math GCC emits rsqrtss (relative error below
#: 1.5 * 2**-12) and one Newton step, which leaves 1.5 * (1.5 * 2**-12)**2 = 3.4u and adds four
#: roundings of its own: 8u in all.
KERNEL_RSQRT_ROUNDINGS = 8


def normed_difference(dim: int) -> float:
    """How far apart, relatively, the kernel's and the reference's float32 `x * inv` may be,
    inv = 1 / sqrt(sum(x^2) / dim + eps).

    On each side: the squares and their sum, in any order, with FMA or not, gamma_dim; the division by
    dim and the + eps, u each (the square root halves these three); then the inverse square root (the
    reference's sqrt and 1 / ..., 2u; the kernel's, KERNEL_RSQRT_ROUNDINGS * u), and the product with x, u.
    """
    u = unit_roundoff(torch.float32)

    def side(inverse_roundings: int) -> float:
        return (gamma(dim) + 2 * u) / 2 + inverse_roundings * u + u

    return side(2) + side(KERNEL_RSQRT_ROUNDINGS)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**20), rows=st.sampled_from([1, 3, 32, 200]), dim=st.sampled_from([1, 7, 64, 576]),
       with_residual=st.booleans())
def test_rms_norm_float32_matches_the_reference(kernels, seed, rows, dim, with_residual) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, dim, generator=gen) * 3
    weight = torch.rand(dim, generator=gen) + 0.5
    residual = torch.randn(rows, dim, generator=gen) if with_residual else None
    want_h = h + residual if with_residual else h.clone()
    got = kernels.rms_norm(h, weight, 1e-5, residual)
    assert torch.equal(h, want_h)  # the residual went into h, in place, with torch's one rounding
    # Beyond `x * inv`, each side rounds once more for the weight: relative to the value, u on each
    # side, and a third u for measuring from the reference's rounded value.
    want = reference_norm(want_h, weight, 1e-5)
    bound = (normed_difference(dim) + 3 * unit_roundoff(torch.float32)) * want.abs()
    assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("rows", [1, 32, 700])  # 700 x 576 runs on the OpenMP team
def test_rms_norm_bfloat16_rounds_like_the_reference(kernels, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 576, generator=gen) * 2).to(torch.bfloat16)
    weight = (torch.rand(576, generator=gen) + 0.5).to(torch.bfloat16)
    residual = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    want_h = h + residual
    got = kernels.rms_norm(h, weight, 1e-5, residual)
    assert torch.equal(h, want_h)  # the same bf16 rounding of the add as torch
    want = reference_norm(want_h, weight, 1e-5)
    # Both sides round twice: `x * inv` to bf16, then the weight times that (exact in float32: 8 by 8
    # bits) to bf16. Their float32 `x * inv` differ by at most `normed_difference(576)` (3.5e-5 of the
    # value); where the reference's lies farther than that from a bf16 half-way point, both round it
    # alike and the outputs are the same bits.
    normed = reference_normed(want_h, 1e-5)
    alike = rounds_alike(normed, normed_difference(576) * normed.double().abs(), torch.bfloat16)
    assert torch.equal(got[alike], want[alike])
    # Not vacuous: 3.5e-5 of a value is below 2 * 3.5e-5 * 2**8 = 1.8% of a bf16 step at it, so at
    # least 98% of the values are that far from a half-way point.
    assert alike.double().mean() > 0.9
    # Elsewhere `x * inv` may round to the neighbouring bf16 value: one step s of it. The weight w
    # stretches that to w * s, under two steps of the product w * x (w * s / step(w * x) =
    # w * 2**e / 2**f < 2 for x in [2**e, 2**(e+1)) and w * x in [2**f, 2**(f+1))), and the product's
    # own rounding adds at most one more: the outputs are at most 2 bf16 steps apart.
    assert int(steps_apart(got, want).max()) <= 2


def test_rms_norm_bad_inputs_are_clear_errors(kernels) -> None:
    h, w = torch.randn(4, 8), torch.rand(8)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.rms_norm(h, w.double(), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(h, torch.rand(9), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        kernels.rms_norm(h, w, 1e-5, torch.randn(4, 9))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.rms_norm(torch.randn(8, 4).t(), w, 1e-5)


#: The most positions a sequence of `decoder_run` reaches: a prompt of up to 30, then 12 decodes.
DECODER_RUN_CONTEXT = 30 + 12


def decoder_run(model, with_kernel: bool) -> list[torch.Tensor]:
    """Prefill five prompts in one forward, then twelve batched decode steps of four of them."""
    model.decoder.kernels = cpu_kernels() if with_kernel else None
    rng = random.Random(5)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    store = model.decoder.new_store(4, num_blocks=128)
    for i, ids in enumerate(prompts):
        store.add_sequence(i, len(ids) + 12)
    outs = [model.decoder.forward([SeqChunk(i, ids) for i, ids in enumerate(prompts)], store)]
    for step in range(12):
        outs.append(model.decoder.forward([SeqChunk(i, [3 + (step * 7 + i) % 50]) for i in range(4)], store))
    return [o.float() for o in outs]


@pytest.mark.parametrize("variant", ["llama", "llama-untied-llama3-rope", "qwen2", "mistral-window", "qwen3",
                                     "smollm3-nope", "gemma3", "phi3-longrope", "llama-dynamic-rope"])
def test_the_decoder_gives_the_same_float32_logits_with_and_without_the_kernel(tiny_variant_dirs, variant) -> None:
    model = load_model(tiny_variant_dirs[variant], device="cpu", dtype="float32")
    assert model.decoder.kernels is not None  # on by default on the CPU
    for got, want in zip(decoder_run(model, True), decoder_run(model, False)):
        # Two float32 forwards that sum in different orders (the kernels' and torch's).
        assert float((got - want).abs().max()) <= logits_tolerance(model.config, DECODER_RUN_CONTEXT, want)


def test_in_bfloat16_the_kernel_and_gather_and_sdpa_stay_within_bf16_rounding_of_float32(tiny_variant_dirs) -> None:
    """Both attention paths sum in float32 and round their output to bf16 once, so in a bf16 forward
    each sits within the bf16 forward's own rounding of the float32 logits (the kernel against the
    exact attention: test_bfloat16_matches_the_reference_to_bf16_rounding)."""
    fp32 = load_model(tiny_variant_dirs["llama"], device="cpu", dtype="float32")
    truth = decoder_run(fp32, False)
    bf16 = load_model(tiny_variant_dirs["llama"], device="cpu", dtype="bfloat16")
    for with_kernel in (True, False):
        for got, want in zip(decoder_run(bf16, with_kernel), truth):
            tolerance = logits_tolerance(fp32.config, DECODER_RUN_CONTEXT, want, torch.bfloat16)
            assert float((got - want).abs().max()) <= tolerance, with_kernel


def test_without_a_compiler_the_decoder_falls_back(monkeypatch, caplog) -> None:
    monkeypatch.setattr(build_module.shutil, "which", lambda _name: None)
    with caplog.at_level(logging.WARNING, logger="ferrox_batch.runtime.kernels"):
        assert kernels_module.cpu_kernels.__wrapped__() is None
    assert "no GCC found" in caplog.text


def test_clang_is_not_used(monkeypatch, tmp_path) -> None:
    """Clang's -fopenmp would bring LLVM's OpenMP runtime beside torch's libgomp."""
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'clang version 17.0.6'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(build_module.shutil, "which", lambda name: str(fake) if name == "cc" else None)
    assert build_module._gnu_compiler() is None
    fake.write_text("#!/bin/sh\necho 'cc (Debian 12.2.0-14) 12.2.0'; echo 'Copyright (C) 2022 Free Software Foundation, Inc.'\n")
    assert build_module._gnu_compiler() == str(fake)


def test_a_source_that_does_not_compile_falls_back_with_the_reason(monkeypatch, tmp_path, caplog) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(build_module, "CSRC", tmp_path)
    monkeypatch.setattr(build_module, "SOURCES", ("broken.c",))
    with caplog.at_level(logging.WARNING, logger="ferrox_batch.runtime.kernels"):
        assert kernels_module.cpu_kernels.__wrapped__() is None
    assert "did not build" in caplog.text and "broken.c" in caplog.text


def check_against_the_references(built: CpuKernels) -> None:
    """The attention kernels and the norm, in float32 and bf16, within the bounds their tests derive."""
    for dtype in (torch.float32, torch.bfloat16):
        q, pool, tables, lo, hi = random_case(random.Random(11), 5, 3, 3, 64, 16, 9, dtype)
        got = built.paged_decode(q, pool, tables, lo, hi, 16, 0.125).double()
        want = reference(q, pool, tables, lo, hi, 16, 0.125)
        bound = decode_error_bound(q, pool, tables, lo, hi, 16, 0.125)
        if dtype == torch.bfloat16:
            bound = bound + steps(0.5, want.abs() + bound, dtype)
        assert bool(((got - want).abs() <= bound).all()), dtype
        q, pool, chunks = prefill_case(random.Random(12), 3, 3, 64, dtype, pool_dtype=torch.float16)
        got = built.prefill_attention(q, pool, PrefillPlan.of(chunks), 0.125, 9).double().view(q.shape)
        qd, tables, lo, hi = prefill_as_decode(q, pool, chunks, 9)
        want = reference(qd, pool.float(), tables, lo, hi, 1, 0.125).view(q.shape)
        bound = decode_error_bound(qd, pool.float(), tables, lo, hi, 1, 0.125).view(q.shape)
        if dtype == torch.bfloat16:
            bound = bound + steps(0.5, want.abs() + bound, dtype)
        assert bool(((got - want).abs() <= bound).all()), dtype
        gen = torch.Generator().manual_seed(11)
        h = torch.randn(40, 576, generator=gen).to(dtype)
        weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
        got = built.rms_norm(h, weight, 1e-5)
        want = reference_norm(h, weight, 1e-5)
        if dtype == torch.bfloat16:
            assert int(steps_apart(got, want).max()) <= 2
        else:
            bound = (normed_difference(576) + 3 * unit_roundoff(dtype)) * want.abs()
            assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("flags", build_module.COMPILE_FLAGS, ids=" ".join)
def test_every_flag_set_builds_kernels_that_match_the_references(kernels_built_with, flags) -> None:
    """The first flag set that compiles is the one used: on x86-64, `-march=native` code for the CPU
    that builds it (AVX-512 on an AVX-512 machine, AVX2 + FMA on an AVX2 one). The later sets are
    what a machine gets where the earlier do not compile; the last targets the compiler's baseline
    (SSE2 on x86-64). Each is built and checked here, so every machine also tests the code another
    CPU would run. On x86-64 GCC takes every set; elsewhere the last must build."""
    built = kernels_built_with(flags)
    if built is None:
        assert platform.machine() not in ("x86_64", "AMD64") and flags != BASELINE_FLAGS, flags
        return
    check_against_the_references(built)


def test_results_do_not_depend_on_the_thread_count(kernels) -> None:
    """The suite runs torch with one thread; here both kernels also run on a team of two (and
    from two threads at once), where each sequence and each row is still one thread's work."""
    q, pool, tables, lo, hi = random_case(random.Random(9), 6, 3, 3, 64, 16, None, torch.bfloat16)
    h = torch.randn(800, 576).to(torch.bfloat16)  # big enough for the norm to use the team
    weight, residual = torch.rand(576).to(torch.bfloat16), torch.randn(800, 576).to(torch.bfloat16)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h2 = h.clone()
        return kernels.paged_decode(q, pool, tables, lo, hi, 16, 0.125), kernels.rms_norm(h2, weight, 1e-5, residual), h2

    alone = run()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results: list = []
        workers = [threading.Thread(target=lambda: results.append(run())) for _ in range(2)]
        for w in workers:
            w.start()
        results.append(run())
        for w in workers:
            w.join(30)
    finally:
        torch.set_num_threads(threads)
    assert len(results) == 3
    for got in results:
        assert all(torch.equal(a, b) for a, b in zip(got, alone))
