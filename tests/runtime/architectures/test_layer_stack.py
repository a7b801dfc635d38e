"""The layer stack (`runtime.architectures.layer_stack`, `csrc/layer_stack.c`): every layer in one C call gives the Python
loop's logits bit for bit, applies exactly where each projection is one fp16 panel kernel, each one a
packed quantized weight (in float32 and bf16) or each one the bf16 kernel, and refuses inputs it cannot
read."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_builds import built_kernels, needs_compiler
from numerics import logits_tolerance

from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk, build_inputs
from ferrox_batch.runtime.loading.loader import load_model

pytestmark = needs_compiler

#: The most positions a sequence of `mixed_schedule` reaches: a prompt of up to 30 and six decodes, or
#: three chunks of up to 9.
MIXED_CONTEXT = 36


def mixed_schedule(model, with_stack: bool) -> list[torch.Tensor]:
    """Prompts in one forward (one with every position's logits), then forwards that mix decodes with
    prompt chunks after a cached prefix (and past a sliding window where the model has one)."""
    decoder = model.decoder
    saved = decoder.layer_stack
    if not with_stack:
        decoder.layer_stack = None
    try:
        rng = random.Random(7)
        vocab = model.config.vocab_size
        store = decoder.new_store(4, num_blocks=256)
        for seq in range(5):
            store.add_sequence(seq, 120)
        # The first forward also asks for every position's logits of its second prompt (prompt logprobs).
        last, every = decoder.forward_every([SeqChunk(seq, [rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))])
                                             for seq in range(3)], store, (1,))
        outs = [last, *every]
        for step in range(6):
            batch = [SeqChunk(seq, [rng.randrange(3, vocab)]) for seq in range(3)]
            batch.append(SeqChunk(3 + step % 2, [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]))
            outs.append(decoder.forward(batch, store))
        return outs
    finally:
        decoder.layer_stack = saved


@pytest.mark.parametrize("variant", ["llama", "llama-untied-llama3-rope", "mistral-window", "qwen3"])
def test_the_stack_gives_the_python_loops_logits_bit_for_bit(tiny_variant_dirs, variant) -> None:
    model = load_model(tiny_variant_dirs[variant], device="cpu", dtype="fp16w")
    if not built_kernels().f16_gemm_vectorised:  # no fp16 panel kernel here: the layers run fbgemm
        assert model.decoder.layer_stack is None
        return
    assert model.decoder.layer_stack is not None
    for got, want in zip(mixed_schedule(model, True), mixed_schedule(model, False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("variant", "weights"), [("llama", "q8_0"), ("llama-untied-llama3-rope", "q4_1"),
                                                  ("mistral-window", "q5_0")])
def test_over_quantized_weights_the_stack_gives_the_python_loops_logits_bit_for_bit(tiny_variant_dirs, variant,
                                                                                    weights, dtype) -> None:
    model = load_model(tiny_variant_dirs[variant], device="cpu", dtype=dtype, weights=weights)
    assert model.decoder.layer_stack is not None and model.decoder.layer_stack.kind == "quantized"
    for got, want in zip(mixed_schedule(model, True), mixed_schedule(model, False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("variant", ["llama", "llama-untied-llama3-rope", "mistral-window"])
def test_over_bf16_weights_the_stack_gives_the_python_loops_logits_bit_for_bit(tiny_variant_dirs, variant) -> None:
    model = load_model(tiny_variant_dirs[variant], device="cpu", dtype="bf16", batch_invariant="on")
    assert model.decoder.layer_stack is not None and model.decoder.layer_stack.kind == "bf16_panels"
    for got, want in zip(mixed_schedule(model, True), mixed_schedule(model, False)):
        assert torch.equal(got, want)


def test_over_quantized_weights_it_needs_every_projection_packed(tiny_variant_dirs) -> None:
    """The weight-only kernel, or a bias (Qwen2's q|k|v), keeps the Python loop."""
    path = tiny_variant_dirs["llama"]
    assert load_model(path, device="cpu", weights="q8_0", int8_activations=False).decoder.layer_stack is None
    assert load_model(tiny_variant_dirs["qwen2"], device="cpu", weights="q8_0").decoder.layer_stack is None


def test_it_applies_only_where_every_projection_is_one_fp16_panel_kernel(tiny_variant_dirs) -> None:
    assert load_model(tiny_variant_dirs["llama"], device="cpu", dtype="fp32").decoder.layer_stack is None
    # bf16 on oneDNN's kernels; with our bf16 kernel, a bias (Qwen2's q|k|v) keeps the loop.
    assert load_model(tiny_variant_dirs["llama"], device="cpu", dtype="bf16",
                      batch_invariant="off").decoder.layer_stack is None
    assert load_model(tiny_variant_dirs["qwen2"], device="cpu", dtype="bf16",
                      batch_invariant="on").decoder.layer_stack is None
    # Attention biases: the q|k|v projection is a panel kernel and an add.
    qwen = load_model(tiny_variant_dirs["qwen2"], device="cpu", dtype="fp16w")
    assert qwen.decoder.layer_stack is None
    # Layers without RoPE (SmolLM3) are the Python loop's too (per-head query/key norms, Qwen3's, are not).
    assert load_model(tiny_variant_dirs["smollm3-nope"], device="cpu", dtype="fp16w").decoder.layer_stack is None
    # Without the kernels object the decoder runs its Python loop with torch's attention, norms and RoPE,
    # stack or not: the same float32 forward summed in other orders.
    model = load_model(tiny_variant_dirs["llama"], device="cpu", dtype="fp16w")
    with_kernels = mixed_schedule(model, True)
    model.decoder.kernels = None
    try:
        for got, want in zip(mixed_schedule(model, True), with_kernels):
            assert float((got - want).abs().max()) <= logits_tolerance(model.config, MIXED_CONTEXT, want)
    finally:
        model.decoder.kernels = cpu_kernels()


def test_inputs_it_cannot_read_are_clear_errors(tiny_variant_dirs) -> None:
    model = load_model(tiny_variant_dirs["llama"], device="cpu", dtype="fp16w")
    stack = model.decoder.layer_stack
    if stack is None:
        assert not built_kernels().f16_gemm_vectorised
        return
    decoder = model.decoder
    store = decoder.new_store(4, num_blocks=16)
    store.add_sequence("s", 8)
    inputs = build_inputs([SeqChunk("s", [3, 4, 5])], store, model.config.vocab_size, None, decode_gather=False)
    h = torch.randn(3, model.config.hidden_size)
    args = (inputs, None, store.kv, store.block_size, decoder.cos, decoder.sin)
    with pytest.raises(ValueError, match="pool"):
        stack.run(decoder.kernels, h, inputs, None, store.kv.double(), store.block_size, decoder.cos, decoder.sin)
    with pytest.raises(ValueError, match="pool"):
        stack.run(decoder.kernels, h, inputs, None, store.kv[:1], store.block_size, decoder.cos, decoder.sin)
    with pytest.raises(ValueError, match="float32"):
        stack.run(decoder.kernels, h.double(), *args)
    inputs.positions = inputs.positions.int()
    with pytest.raises(ValueError, match="int64"):
        stack.run(decoder.kernels, h, *args)
