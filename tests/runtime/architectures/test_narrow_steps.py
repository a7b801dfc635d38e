"""Narrow steps over a second copy of the weights (`Linear`'s `narrow_panels`, `LayerStack.takes`,
`--batch-invariant narrow`, auto's choice on AMX CPUs): oneDNN runs the bf16 layers, and the layer stack runs
the steps of at most `NARROW_STEP_ROWS` rows over the same weights in our kernel's panels.

What is checked: which steps take the stack; that the copy is exactly our kernel's panels (the stack over it
gives the `on` model's stack's logits bit for bit); that the wide steps are the oneDNN loop's bit for bit; that
the narrow steps agree with the loop within the two summation orders' bound; what the copy costs in bytes;
that no copy is kept where the stack will not run it; and that `auto` picks it on an AMX CPU."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_builds import needs_compiler
from numerics import logits_tolerance

from ferrox_batch.runtime.architectures import layer_stack
from ferrox_batch.runtime.architectures.layer_stack import NARROW_STEP_ROWS, LayerStack
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.device import CpuFeatures
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.loader import LoadedModel, load_model

pytestmark = needs_compiler


def steps(rng: random.Random, vocab: int) -> list[list[SeqChunk]]:
    """A wide prefill (more than `NARROW_STEP_ROWS` rows), then narrow steps: decodes of the three sequences,
    a draft-sized chunk of `NARROW_STEP_ROWS` rows, then one row past it."""
    token = lambda: rng.randrange(3, vocab)
    out = [[SeqChunk(seq, [token() for _ in range(8)]) for seq in range(3)]]
    for _ in range(3):
        out.append([SeqChunk(seq, [token()]) for seq in range(3)])
    out.append([SeqChunk(0, [token() for _ in range(NARROW_STEP_ROWS)])])
    out.append([SeqChunk(1, [token() for _ in range(NARROW_STEP_ROWS + 1)])])
    return out


def run(model: LoadedModel, schedule: list[list[SeqChunk]]) -> list[torch.Tensor]:
    store = model.decoder.new_store(4, num_blocks=64)
    for seq in range(3):
        store.add_sequence(seq, 60)
    return [model.decoder.forward(batch, store) for batch in schedule]


@pytest.fixture
def stack_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every forward that went through `LayerStack.run`."""
    calls: list[int] = []
    inner = LayerStack.run

    def spy(self: LayerStack, kernels: object, h: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(h.shape[0])
        return inner(self, kernels, h, *args, **kwargs)

    monkeypatch.setattr(LayerStack, "run", spy)
    return calls


def test_the_stack_takes_the_narrow_steps_and_the_loop_the_wide_ones(tiny_variant_dirs, stack_calls) -> None:
    model = load_model(tiny_variant_dirs["llama"], device="cpu", dtype="bf16", batch_invariant="narrow")
    decoder = model.decoder
    assert set(decoder.linear_kinds) == {"mkldnn"} and not model.batch_invariant
    assert decoder.layer_stack is not None and decoder.layer_stack.narrow_only
    schedule = steps(random.Random(3), model.config.vocab_size)
    run(model, schedule)
    assert stack_calls == [3, 3, 3, NARROW_STEP_ROWS]  # not the 24-row prefill, not the 17-row chunk
    # Over its own weights (`on`) the stack takes every step.
    on = load_model(tiny_variant_dirs["llama"], device="cpu", dtype="bf16", batch_invariant="on")
    assert not on.decoder.layer_stack.narrow_only and on.decoder.layer_stack.takes(10 ** 6)


def test_the_copy_is_our_kernels_panels_and_the_wide_steps_are_onednns(tiny_variant_dirs,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_variant_dirs["llama"]
    narrow = load_model(path, device="cpu", dtype="bf16", batch_invariant="narrow")
    on = load_model(path, device="cpu", dtype="bf16", batch_invariant="on")
    off = load_model(path, device="cpu", dtype="bf16", batch_invariant="off")
    schedule = steps(random.Random(5), narrow.config.vocab_size)
    # Every step through the stack, and `on`'s head swapped for narrow's oneDNN one: the same logits bit for
    # bit, so the stack read exactly the panels `on` runs.
    monkeypatch.setattr(layer_stack, "NARROW_STEP_ROWS", 10 ** 6)
    on.decoder.lm_head = narrow.decoder.lm_head
    for got, want in zip(run(narrow, schedule), run(on, schedule)):
        assert torch.equal(got, want)
    # Every step through the loop: `off`'s logits bit for bit (the copy changes nothing of oneDNN's path).
    narrow.decoder.layer_stack = None
    for got, want in zip(run(narrow, schedule), run(off, schedule)):
        assert torch.equal(got, want)


def test_narrow_steps_agree_with_the_loop_within_the_summation_orders_bound(tiny_variant_dirs) -> None:
    path = tiny_variant_dirs["llama"]
    narrow = load_model(path, device="cpu", dtype="bf16", batch_invariant="narrow")
    off = load_model(path, device="cpu", dtype="bf16", batch_invariant="off")
    schedule = steps(random.Random(9), narrow.config.vocab_size)
    context = 8 + 3 + NARROW_STEP_ROWS + 1
    for got, want in zip(run(narrow, schedule), run(off, schedule)):
        # Two bf16 forwards, each within one side's bound of the exact logits.
        bound = 2 * logits_tolerance(narrow.config, context, want.float(), torch.bfloat16, sides=1)
        assert float((got.float() - want.float()).abs().max()) <= bound


def test_a_layer_holds_the_copy_only_where_onednn_runs_a_bf16_weight_without_bias() -> None:
    kernels = cpu_kernels()
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    plain = Linear(weight.clone(), kernels=kernels)
    copy = Linear(weight.clone(), kernels=kernels, narrow_panels=True)
    assert plain.kind == copy.kind == "mkldnn"
    assert plain.bf16_panels is None and not plain.narrow_only
    assert copy.bf16_panels is not None and copy.narrow_only
    assert copy.nbytes == plain.nbytes + copy.bf16_panels.nbytes
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(copy(x), plain(x))  # the layer itself still runs oneDNN
    # A bias (the stack runs none), an fp32 weight, or our kernel already running it: no copy.
    biased = Linear(weight.clone(), torch.zeros(48, dtype=torch.bfloat16), kernels=kernels, narrow_panels=True)
    assert not biased.narrow_only and biased.bf16_panels is None
    assert not Linear(weight.float(), kernels=kernels, narrow_panels=True).narrow_only
    invariant = Linear(weight.clone(), kernels=kernels, batch_invariant=True, narrow_panels=True)
    assert invariant.kind == "bf16_panels" and not invariant.narrow_only


def test_the_loaded_model_counts_both_copies(tiny_variant_dirs) -> None:
    path = tiny_variant_dirs["llama"]
    narrow = load_model(path, device="cpu", dtype="bf16", batch_invariant="narrow").decoder
    off = load_model(path, device="cpu", dtype="bf16", batch_invariant="off").decoder
    layers = sum(lin.bf16_panels.nbytes for layer in narrow.layers
                 for lin in (layer.qkv, layer.o, layer.gate_up._linear, layer.down))
    assert narrow.weight_bytes == off.weight_bytes + layers
    assert not narrow.lm_head.narrow_only  # the head is one Python call whatever the step


@pytest.mark.parametrize("variant", ["qwen2", "gemma3", "smollm3-nope"])
def test_no_copy_is_kept_where_the_stack_does_not_run_the_layers(tiny_variant_dirs, variant) -> None:
    """A bias (Qwen2), Gemma 3's scalings and GELU, layers without RoPE (SmolLM3): the Python loop runs every
    step, so the copy would be memory nothing reads."""
    path = tiny_variant_dirs[variant]
    narrow = load_model(path, device="cpu", dtype="bf16", batch_invariant="narrow")
    off = load_model(path, device="cpu", dtype="bf16", batch_invariant="off")
    assert narrow.decoder.layer_stack is None
    assert narrow.decoder.weight_bytes == off.decoder.weight_bytes
    assert "no second copy" in narrow.batch_invariant_reason


@pytest.mark.parametrize(("dtype", "weights"), [("fp32", "auto"), ("fp16w", "auto"), ("bf16", "q8_0"),
                                                ("fp32", "q4_1")])
def test_narrow_changes_nothing_of_a_load_without_dense_bf16_layers(tiny_variant_dirs, dtype, weights) -> None:
    path = tiny_variant_dirs["llama"]
    narrow = load_model(path, device="cpu", dtype=dtype, weights=weights, batch_invariant="narrow").decoder
    off = load_model(path, device="cpu", dtype=dtype, weights=weights, batch_invariant="off").decoder
    assert narrow.linear_kinds == off.linear_kinds and narrow.weight_bytes == off.weight_bytes
    assert (narrow.layer_stack is None) == (off.layer_stack is None)
    assert narrow.layer_stack is None or not narrow.layer_stack.narrow_only


def test_auto_holds_the_copy_on_an_amx_cpu(tiny_variant_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    amx = CpuFeatures("x86_64", avx512_bf16=True, amx=True, fbgemm=True)
    monkeypatch.setattr(CpuFeatures, "probe", classmethod(lambda cls: amx))
    model = load_model(tiny_variant_dirs["llama"], device="cpu", dtype="bf16")
    assert set(model.decoder.linear_kinds) == {"mkldnn"} and model.decoder.layer_stack.narrow_only
    assert "AMX" in model.batch_invariant_reason and not model.batch_invariant
