"""`--batch-invariant` (`runtime.invariance`): what auto, on and off choose on each kind of machine, what the
loaded decoder reports, that `on` refuses a load it cannot make invariant, and that the bf16 kernel's linear
layers agree with oneDNN's within the two summation orders' bound."""

from __future__ import annotations

import pytest
import torch
from kernel_builds import needs_compiler
from numerics import logits_tolerance

from ferrox_batch.runtime.device import CpuFeatures
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.invariance import choose_batch_invariance
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.loader import load_model

CPU = torch.device("cpu")
ZEN4 = CpuFeatures("x86_64", avx512_bf16=True, amx=False, fbgemm=True)
SAPPHIRE_RAPIDS = CpuFeatures("x86_64", avx512_bf16=True, amx=True, fbgemm=True)


def test_auto_prefers_our_kernels_except_for_bf16_on_amx() -> None:
    assert choose_batch_invariance("auto", torch.bfloat16, CPU, ZEN4).prefer
    amx = choose_batch_invariance(None, torch.bfloat16, CPU, SAPPHIRE_RAPIDS)
    assert not amx.prefer and "AMX" in amx.reason
    # There oneDNN runs the layers, and a second copy in our kernel's panels the narrow steps.
    assert amx.narrow_panels and not amx.required
    assert not choose_batch_invariance("auto", torch.bfloat16, CPU, ZEN4).narrow_panels
    # Where no oneDNN bf16 kernel is in play, AMX changes nothing.
    assert choose_batch_invariance("auto", torch.float32, CPU, SAPPHIRE_RAPIDS).prefer
    assert not any(choose_batch_invariance("auto", dtype, CPU, ZEN4).required for dtype in (torch.bfloat16,
                                                                                            torch.float32))


def test_on_and_off_and_the_refusals() -> None:
    on = choose_batch_invariance(True, torch.bfloat16, CPU, SAPPHIRE_RAPIDS)
    assert on.prefer and on.required
    assert choose_batch_invariance("on", torch.float32, CPU, ZEN4).required
    off = choose_batch_invariance("off", torch.bfloat16, CPU, ZEN4)
    assert not off.prefer and not off.required
    assert not choose_batch_invariance("auto", torch.bfloat16, torch.device("cuda"), ZEN4).prefer
    assert not any(choose_batch_invariance(asked, torch.bfloat16, CPU, SAPPHIRE_RAPIDS).narrow_panels
                   for asked in ("on", "off"))
    for features in (ZEN4, SAPPHIRE_RAPIDS):  # narrow asks for auto's AMX choice on any CPU
        narrow = choose_batch_invariance("narrow", torch.bfloat16, CPU, features)
        assert narrow.narrow_panels and not narrow.prefer and not narrow.required
    for asked in ("on", "narrow"):
        with pytest.raises(ValueError, match="needs the CPU's kernels"):
            choose_batch_invariance(asked, torch.bfloat16, torch.device("cuda"), ZEN4)
    with pytest.raises(ValueError, match="unknown batch-invariant choice"):
        choose_batch_invariance("sometimes", torch.bfloat16, CPU, ZEN4)


@needs_compiler
def test_the_loaded_decoder_reports_it_and_on_refuses_what_it_cannot_make_invariant(tiny_variant_dirs) -> None:
    path = tiny_variant_dirs["llama"]
    on = load_model(path, device="cpu", dtype="bf16", batch_invariant="on")
    assert on.batch_invariant and set(on.decoder.linear_kinds) == {"bf16_panels"}
    off = load_model(path, device="cpu", dtype="bf16", batch_invariant="off")
    assert not off.batch_invariant and "bf16_panels" not in off.decoder.linear_kinds
    assert load_model(path, device="cpu", weights="q8_0", batch_invariant="on").batch_invariant
    with pytest.raises(ModelLoadError, match="not every linear layer runs a batch-invariant kernel"):
        load_model(path, device="cpu", dtype="fp32", batch_invariant="on")  # fp32 dense: oneDNN only
    with pytest.raises(ValueError, match="unknown batch-invariant choice"):
        load_model(path, device="cpu", batch_invariant="maybe")
    # The same model on either kernel: two bf16 forwards, each within one side's bound of the exact logits.
    outs = []
    for model in (on, off):
        store = model.decoder.new_store(4, num_blocks=32)
        store.add_sequence(0, 40)
        outs.append(model.decoder.forward([SeqChunk(0, list(range(3, 30)))], store))
    bound = 2 * logits_tolerance(on.config, 27, outs[1], torch.bfloat16, sides=1)
    assert float((outs[0] - outs[1]).abs().max()) <= bound


@needs_compiler
def test_a_biased_projection_adds_its_bias_before_the_one_rounding(tiny_variant_dirs) -> None:
    """Qwen2's q|k|v bias: the bf16 kernel's float32 sums, plus the bias, rounded once (as oneDNN fuses it)."""
    model = load_model(tiny_variant_dirs["qwen2"], device="cpu", dtype="bf16", batch_invariant="on")
    qkv = model.decoder.layers[0].qkv
    assert qkv.kind == "bf16_panels" and qkv.bias is not None and qkv.bf16_panels is None
    x = torch.randn(5, qkv._in_features).bfloat16()
    want = (qkv._packed(x, out_f32=True) + qkv.bias.float()).bfloat16()
    assert torch.equal(qkv(x), want)


@needs_compiler
@pytest.mark.parametrize(("variant", "dtype", "weights"), [("llama", "bf16", "auto"), ("mistral-window", "bf16", "auto"),
                                                           ("llama", "fp32", "q8_0"), ("qwen3", "bf16", "auto"),
                                                           ("olmoe", "bf16", "auto"), ("qwen3_moe", "bf16", "auto")])
def test_a_sequences_logits_do_not_depend_on_its_chunks_or_its_neighbours(tiny_variant_dirs, variant, dtype,
                                                                          weights) -> None:
    """Batch-invariant kernels, attention included: one prompt prefilled whole and alone, then decoded alone,
    against the same prompt prefilled in three chunks, each in a forward with other sequences' prompt chunks
    and decodes, then decoded beside them: every logit equal, bit for bit (a window smaller than the prompt,
    per-head norms and the Python loop included). What this pins is the attention kernels' side: at these
    tiny widths oneDNN's linears happen to be invariant too, and the real model's concurrent test is where
    theirs is seen to differ."""
    model = load_model(tiny_variant_dirs[variant], device="cpu", dtype=dtype, weights=weights, batch_invariant="on")
    decoder = model.decoder
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, vocab, (40,), generator=gen).tolist()
    others = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 23, 12)]
    steps = [int(t) for t in torch.randint(3, vocab, (5,), generator=gen)]

    store = decoder.new_store(4, num_blocks=128)
    store.add_sequence("p", 64)
    alone = [decoder.forward([SeqChunk("p", prompt)], store)[0]]
    alone += [decoder.forward([SeqChunk("p", [t])], store)[0] for t in steps]

    store = decoder.new_store(4, num_blocks=128)
    for name in ("p", 0, 1, 2):
        store.add_sequence(name, 64)
    decoder.forward([SeqChunk(0, others[0])], store)
    decoder.forward([SeqChunk(1, others[1][:10]), SeqChunk("p", prompt[:13])], store)
    decoder.forward([SeqChunk(0, [5]), SeqChunk("p", prompt[13:29]), SeqChunk(1, others[1][10:])], store)
    last = decoder.forward([SeqChunk(0, [6]), SeqChunk(1, [7]), SeqChunk(2, others[2]), SeqChunk("p", prompt[29:])],
                           store)
    together = [last[3]]
    for i, t in enumerate(steps):
        batch = [SeqChunk(0, [8 + i]), SeqChunk("p", [t]), SeqChunk(2, [9 + i])]
        together.append(decoder.forward(batch, store)[1])
    for step, (one, many) in enumerate(zip(alone, together)):
        assert torch.equal(one, many), f"step {step}: {float((one - many).abs().max())} apart"


@needs_compiler
@pytest.mark.parametrize(("variant", "dtype", "weights", "kernels"),
                         [("llama", "bf16", "auto", True), ("llama", "bf16", "auto", False),
                          ("mistral-window", "bf16", "auto", True), ("llama", "fp32", "q8_0", True)])
def test_a_chunk_answered_as_decodes_is_the_steps_it_stands_for(tiny_variant_dirs, variant, dtype, weights,
                                                                kernels) -> None:
    """A speculative draft's verification (`SeqChunk.as_decodes`): its tokens fed in one forward, beside
    another row's decode and a prompt chunk, give every position's logits bit for bit as the one-token steps
    would, one after another (the C kernels, and torch's ops)."""
    model = load_model(tiny_variant_dirs[variant], device="cpu", dtype=dtype, weights=weights, batch_invariant="on")
    decoder = model.decoder
    if not kernels:
        decoder.kernels = None
        decoder.layer_stack = None
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, vocab, (30,), generator=gen).tolist()
    draft = torch.randint(3, vocab, (6,), generator=gen).tolist()

    store = decoder.new_store(4, num_blocks=128)
    store.add_sequence("p", 64)
    decoder.forward([SeqChunk("p", prompt)], store)
    steps = [decoder.forward([SeqChunk("p", [t])], store)[0] for t in draft]

    store = decoder.new_store(4, num_blocks=128)
    for name in ("p", 0, 1):
        store.add_sequence(name, 64)
    decoder.forward([SeqChunk("p", prompt), SeqChunk(0, prompt[:9])], store)
    batch = [SeqChunk(0, [7]), SeqChunk(1, prompt[5:17]), SeqChunk("p", draft, as_decodes=True)]
    last, (every,) = decoder.forward_every(batch, store, [2])
    assert store.seq_len("p") == len(prompt) + len(draft)
    assert torch.equal(last[2], every[-1])
    for position, (one, verified) in enumerate(zip(steps, every)):
        assert torch.equal(one, verified), f"position {position}: {float((one - verified).abs().max())} apart"
