"""The CPU kernels (paged decode attention, RMSNorm): against float64 references, inside the decoder, their build."""

from __future__ import annotations

import logging
import random
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.models import cpu_kernels as kernels_module
from ferrox_batch.models.batch_inputs import SeqChunk
from ferrox_batch.models.loader import load_model
from ferrox_batch.models.openmp import loaded_openmp_runtimes
from ferrox_batch.models.cpu_kernels import CpuKernels, cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="the kernels are built with the system C compiler")


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    built = cpu_kernels()
    assert built is not None, "a C compiler is on PATH, so the kernels must build"
    return built


def random_case(rng: random.Random, n: int, kv: int, g: int, d: int, block: int, window: int | None, dtype):
    """A pool with randomly placed blocks, and what each sequence attends to."""
    lens = [rng.randint(1, 40) for _ in range(n)]
    blocks = [-(-length // block) for length in lens]
    order = list(range(1, sum(blocks) + 3))  # block 0 stays unused, as in the store
    rng.shuffle(order)
    tables = torch.zeros(n, max(blocks), dtype=torch.long)
    used = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = torch.tensor(order[used:used + count])
        used += count
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    pool = torch.randn((sum(blocks) + 3) * block, 2, kv, d, generator=gen).to(dtype)
    q = torch.randn(n, kv, g, d, generator=gen).to(dtype)
    hi = torch.tensor(lens)
    lo = torch.zeros(n, dtype=torch.long) if window is None else (hi - window).clamp(min=0)
    return q, pool, tables, lo, hi


def reference(q, pool, tables, lo, hi, block):
    """Gather each sequence's keys and values and attend in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        pos = torch.arange(int(lo[i]), int(hi[i]))
        slots = tables[i, pos // block] * block + pos % block
        ctx = pool.double()[slots]  # [L, 2, kv, d]
        k, v = ctx[:, 0].transpose(0, 1), ctx[:, 1].transpose(0, 1)  # [kv, L, d]
        out[i] = F.scaled_dot_product_attention(q[i].double(), k, v)
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    n=st.integers(1, 6),
    kv=st.integers(1, 3),
    g=st.integers(1, 4),
    d=st.sampled_from([4, 16, 24, 64]),
    block=st.sampled_from([1, 3, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 12)),
)
def test_float32_matches_the_reference(kernels, seed, n, kv, g, d, block, window) -> None:
    q, pool, tables, lo, hi = random_case(random.Random(seed), n, kv, g, d, block, window, torch.float32)
    got = kernels.paged_decode(q, pool, tables, lo, hi, block, d ** -0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, pool, tables, lo, hi, block), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_bfloat16_matches_the_reference_to_bf16_rounding(kernels, seed) -> None:
    rng = random.Random(seed)
    q, pool, tables, lo, hi = random_case(rng, 5, 3, 3, 64, 16, None if seed % 2 else 9, torch.bfloat16)
    got = kernels.paged_decode(q, pool, tables, lo, hi, 16, 64 ** -0.5)
    want = reference(q, pool, tables, lo, hi, 16)
    assert got.dtype == torch.bfloat16
    # Accumulation is float32, so the one rounding that shows is the bf16 output's: within half a
    # bf16 step of the exact value, and equal to the exact value's rounding but for near-ties.
    assert bool(((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-5).all())
    assert (got == want.to(torch.bfloat16)).double().mean() > 0.97


def test_the_scale_is_applied(kernels) -> None:
    q, pool, tables, lo, hi = random_case(random.Random(1), 3, 2, 2, 16, 4, None, torch.float32)
    flat = kernels.paged_decode(q, pool, tables, lo, hi, 4, 0.0)  # zero scale: a plain mean of the values
    for i in range(3):
        pos = torch.arange(int(hi[i]))
        values = pool[tables[i, pos // 4] * 4 + pos % 4][:, 1]  # [L, kv, d]
        torch.testing.assert_close(flat[i], values.mean(0)[:, None, :].expand(2, 2, 16), atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_clear_errors(kernels) -> None:
    q, pool, tables, lo, hi = random_case(random.Random(2), 2, 2, 2, 8, 4, None, torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.paged_decode(q.to(torch.bfloat16), pool, tables, lo, hi, 4, 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.paged_decode(q.double(), pool.double(), tables, lo, hi, 4, 1.0)
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
    torch.testing.assert_close(kernels.paged_decode(wide, pool, tables, lo, hi, 4, 0.25), kernels.paged_decode(q, pool, tables, lo, hi, 4, 0.25))


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
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


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
    torch.testing.assert_close(h, want_h)  # the residual went into h, in place
    torch.testing.assert_close(got, reference_norm(want_h, weight, 1e-5), atol=1e-5, rtol=1e-5)


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
    # The statistics are summed in another order, so a value may land one bf16 step away.
    step = want.float().abs() * 2 ** -7
    assert bool(((got.float() - want.float()).abs() <= step + 1e-6).all())
    assert (got != want).float().mean() < 0.02


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


@pytest.mark.parametrize("variant", ["llama", "llama-untied-llama3-rope", "qwen2", "mistral-window"])
def test_the_decoder_gives_the_same_float32_logits_with_and_without_the_kernel(tiny_variant_dirs, variant) -> None:
    model = load_model(tiny_variant_dirs[variant], device="cpu", dtype="float32")
    assert model.decoder.kernels is not None  # on by default on the CPU
    for got, want in zip(decoder_run(model, True), decoder_run(model, False)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_in_bfloat16_the_kernel_is_as_close_to_float32_as_gather_and_sdpa(tiny_variant_dirs) -> None:
    truth = decoder_run(load_model(tiny_variant_dirs["llama"], device="cpu", dtype="float32"), False)
    bf16 = load_model(tiny_variant_dirs["llama"], device="cpu", dtype="bfloat16")
    err = {}
    for with_kernel in (True, False):
        got = decoder_run(bf16, with_kernel)
        err[with_kernel] = sum(float((a - b).abs().mean()) for a, b in zip(got, truth)) / len(truth)
    assert err[True] <= 1.25 * err[False] + 1e-3, err


def test_without_a_compiler_the_decoder_falls_back(monkeypatch, caplog) -> None:
    monkeypatch.setattr(kernels_module.shutil, "which", lambda _name: None)
    with caplog.at_level(logging.WARNING, logger="ferrox_batch.models"):
        assert kernels_module.cpu_kernels.__wrapped__() is None
    assert "no GCC found" in caplog.text


def test_clang_is_not_used(monkeypatch, tmp_path) -> None:
    """Clang's -fopenmp would bring LLVM's OpenMP runtime beside torch's libgomp."""
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'clang version 17.0.6'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(kernels_module.shutil, "which", lambda name: str(fake) if name == "cc" else None)
    assert kernels_module._gnu_compiler() is None
    fake.write_text("#!/bin/sh\necho 'cc (Debian 12.2.0-14) 12.2.0'; echo 'Copyright (C) 2022 Free Software Foundation, Inc.'\n")
    assert kernels_module._gnu_compiler() == str(fake)


def test_a_source_that_does_not_compile_falls_back_with_the_reason(monkeypatch, tmp_path, caplog) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(kernels_module, "CSRC", tmp_path)
    monkeypatch.setattr(kernels_module, "SOURCES", ("broken.c",))
    with caplog.at_level(logging.WARNING, logger="ferrox_batch.models"):
        assert kernels_module.cpu_kernels.__wrapped__() is None
    assert "did not build" in caplog.text and "broken.c" in caplog.text


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
