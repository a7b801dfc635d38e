"""The layer stack over attention with q/k norms and over mixtures of experts (`csrc/layer_stack.c`'s head
norms and `packed_moe.c`): where every projection is a packed quantized weight and every expert too, with a
plain softmax top-k router, the stack gives the Python loop's logits bit for bit (float32 and bf16), and it
declines, saying why, the blocks it has no kernels for."""

from __future__ import annotations

import pytest
import torch
from kernel_builds import needs_compiler
from test_layer_stack import mixed_schedule
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.runtime.architectures.moe import MoeBlock
from ferrox_batch.runtime.loading.loader import load_model

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def stackable(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Mixtures of experts whose every width the int8 kernel takes (whole 32-blocks), so every projection and
    expert is packed: a Qwen3 MoE with a dense middle layer, OLMoE (not renormalised, whole-projection q/k
    norms), Mixtral over a window."""
    folder = tmp_path_factory.mktemp("stackable-moe")
    return {
        "qwen3_moe": write_tiny_checkpoint(folder / "qwen3_moe", arch="qwen3_moe", seed=31, layers=3,
                                           extra_config={"moe_intermediate_size": 64, "mlp_only_layers": [1]}),
        "olmoe": write_tiny_checkpoint(folder / "olmoe", arch="olmoe", seed=32, intermediate=64),
        "mixtral-window": write_tiny_checkpoint(folder / "mixtral", arch="mixtral", seed=33, intermediate=96,
                                                sliding_window=6),
        "qwen2_moe": write_tiny_checkpoint(folder / "qwen2_moe", arch="qwen2_moe", seed=34, extra_config={
            "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "qkv_bias": False}),
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("variant", "weights"), [("qwen3", "q8_0"), ("qwen3_moe", "q8_0"), ("olmoe", "q5_0"),
                                                  ("mixtral-window", "q4_1")])
def test_the_stack_gives_the_python_loops_logits_bit_for_bit(tiny_variant_dirs, stackable, variant, weights,
                                                             dtype) -> None:
    folder = stackable.get(variant) or tiny_variant_dirs[variant]
    model = load_model(folder, device="cpu", dtype=dtype, weights=weights)
    decoder = model.decoder
    assert decoder.layer_stack is not None, decoder.layer_stack_declined
    assert decoder.layer_stack.kind == "quantized"
    if variant in ("qwen3_moe", "olmoe", "mixtral-window"):
        assert any(isinstance(layer.ffn, MoeBlock) for layer in decoder.layers)
    for got, want in zip(mixed_schedule(model, True), mixed_schedule(model, False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("variant", "reason"), [
    ("qwen2_moe", "shared expert"),  # its shared expert and gate run in the Python loop
    ("qwen3_moe", "not all the int8 kernel's packed weights"),  # float32 experts
    ("olmo2", "normalises its output"),
])
def test_the_stack_says_why_it_declines_a_mixture_of_experts(tiny_variant_dirs, stackable, variant, reason) -> None:
    weights = "q8_0" if variant == "qwen2_moe" else "auto"
    folder = stackable["qwen2_moe"] if variant == "qwen2_moe" else tiny_variant_dirs[variant]
    model = load_model(folder, device="cpu", dtype="fp32", weights=weights)
    assert model.decoder.layer_stack is None
    assert reason in (model.decoder.layer_stack_declined or "")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_packed_experts_behind_the_c_router_are_batch_invariant(stackable, dtype) -> None:
    """`--batch-invariant on` takes a packed mixture of experts with a plain router, and a sequence's logits
    are then the same bits alone and beside other sequences (prompt and decode steps, through the stack)."""
    from ferrox_batch.runtime.kv.batch_inputs import SeqChunk

    model = load_model(stackable["qwen3_moe"], device="cpu", dtype=dtype, weights="q8_0", batch_invariant="on")
    decoder = model.decoder
    assert model.batch_invariant and decoder.layer_stack is not None
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, model.config.vocab_size, (21,), generator=gen).tolist()
    other = torch.randint(3, model.config.vocab_size, (13,), generator=gen).tolist()
    steps = [int(t) for t in torch.randint(3, model.config.vocab_size, (4,), generator=gen)]
    store = decoder.new_store(4, num_blocks=64)
    store.add_sequence("p", 32)
    alone = [decoder.forward([SeqChunk("p", prompt)], store)[0]]
    alone += [decoder.forward([SeqChunk("p", [t])], store)[0] for t in steps]
    store = decoder.new_store(4, num_blocks=64)
    for name in ("p", "o"):
        store.add_sequence(name, 32)
    together = [decoder.forward([SeqChunk("o", other), SeqChunk("p", prompt)], store)[1]]
    together += [decoder.forward([SeqChunk("o", [5 + i]), SeqChunk("p", [t])], store)[1] for i, t in enumerate(steps)]
    for one, many in zip(alone, together):
        assert torch.equal(one, many)
