"""Gemma 4 (text) against transformers' own model, and the KV store it needs.

Checkpoints from `gemma4_checkpoints`: local and global layers with heads of different sizes and counts, K=V,
KV-sharing layers, per-layer inputs, soft-capped logits, proportional RoPE. Checked: the last logits against
transformers within `numerics`' tolerance, 32 greedy ids identical, a batch equal to each sequence alone, the
C kernels equal to torch's ops, a store that holds only the layers writing K/V, and the multimodal checkpoint
served as its text model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from batch_helpers import greedy_ids as greedy
from gemma4_checkpoints import VARIANTS, tiny_gemma4
from numerics import assert_decisive, assert_logits_close

from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.families.errors import ModelLoadError
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore
from ferrox_batch.runtime.loading.loader import load_model

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def forward(self, x): return self.layers(x) + 1\nPaged attention stores keys",
    "a",
]


@pytest.fixture(scope="module")
def gemma4_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return {name: tiny_gemma4(root / name, name) for name in VARIANTS}


def reference(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def widest(config: ModelConfig) -> SimpleNamespace:
    """The config as `numerics` counts a logit's float32 terms, along the longest path a layer has: the wider
    heads, the double-wide MLP, plus the per-layer input's gate and projection sums."""
    return SimpleNamespace(hidden_size=config.hidden_size, num_heads=config.num_heads,
                           head_dim=max(config.head_dim, config.global_head_dim or 0),
                           intermediate_size=2 * config.intermediate_size + config.hidden_size
                           + config.per_layer_input_size, num_layers=config.num_layers)


def prefill(model, ids, *, block_size=4, kernels=True):
    decoder = model.decoder
    saved = decoder.kernels
    if not kernels:
        decoder.kernels = None
    try:
        store = decoder.new_store(block_size, num_blocks=256)
        store.add_sequence("s", len(ids) + 8)
        return decoder.forward([SeqChunk("s", ids)], store)[0]
    finally:
        decoder.kernels = saved


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_last_logits_match_transformers(gemma4_dirs, variant):
    folder = gemma4_dirs[variant]
    ours, ref = load_model(folder, device="cpu", dtype="float32"), reference(folder)
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -1]
        for kernels in (True, False):
            got = prefill(ours, ids, kernels=kernels)
            assert_logits_close(got, want, widest(ours.config), len(ids), note=(variant, prompt, kernels))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_32_token_greedy_continuation_is_identical_to_transformers(gemma4_dirs, variant):
    folder = gemma4_dirs[variant]
    ours, ref = load_model(folder, device="cpu", dtype="float32"), reference(folder)
    for prompt in PROMPTS[:2]:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert_decisive([step[0] for step in out.logits], widest(ours.config), len(ids), note=(variant, prompt))
        assert greedy(ours, ids, 32) == out.sequences[0, len(ids):].tolist(), (variant, prompt)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("variant", ["gemma4", "gemma4-moe"])
def test_a_batch_of_prefills_and_decodes_matches_each_sequence_alone(gemma4_dirs, variant, kernels):
    model = load_model(gemma4_dirs[variant], device="cpu", dtype="float32")
    if not kernels:
        model.decoder.kernels = None
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    alone = [prefill(model, ids, kernels=kernels) for ids in prompts]
    store = model.decoder.new_store(4, num_blocks=256)
    for i, ids in enumerate(prompts):
        store.add_sequence(i, len(ids) + 8)
    # The first sequence's prompt but its last token, then its last token as a decode beside the others' prefills.
    model.decoder.forward([SeqChunk(0, prompts[0][:-1])], store)
    batched = model.decoder.forward([SeqChunk(0, prompts[0][-1:]), SeqChunk(1, prompts[1]), SeqChunk(2, prompts[2])],
                                    store)
    for i, want in enumerate(alone):
        assert_logits_close(batched[i], want, widest(model.config), len(prompts[i]), note=i)


@pytest.mark.parametrize("variant", ["gemma4", "gemma4-moe"])
def test_the_c_kernels_decode_as_torch_does(gemma4_dirs, variant):
    model = load_model(gemma4_dirs[variant], device="cpu", dtype="float32")
    assert model.decoder.kernels is not None
    ids = model.tokenizer.encode(PROMPTS[1])
    with_kernels = greedy(model, ids, 16)
    model.decoder.kernels = None
    assert greedy(model, ids, 16) == with_kernels


def test_a_mixture_of_experts_layer_runs_beside_the_mlp(gemma4_dirs):
    model = load_model(gemma4_dirs["gemma4-moe"], device="cpu", dtype="float32")
    layer = model.decoder.layers[0]
    assert layer.post_norm is None  # each branch norms its own input
    assert [type(branch).__name__ for branch in layer.ffn.branches] == ["GatedMlp", "MoeBlock"]
    assert model.decoder.layer_stack_declined is not None


def test_the_kv_store_holds_only_the_layers_that_write_kv(gemma4_dirs):
    model = load_model(gemma4_dirs["gemma4"], device="cpu", dtype="float32")
    c = model.config
    assert c.kv_source == (0, 1, 2, 2, 1)  # the last local and global layers read layers 2 and 1
    assert c.kv_layers == (0, 1, 2)
    store = model.decoder.new_store(4, num_blocks=8)
    # The global layer (one KV head of 48) first, then the two local ones (two heads of 16): groups of one.
    assert store.groups.layers == ((1,), (0,), (2,))
    assert [tuple(pool.shape[2:]) for pool in store.pools] == [(2, 1, 48), (2, 2, 16), (2, 2, 16)]
    # A block's layer slot holds 4 positions of either kind: lcm(4 * 96, 4 * 64) floats, 2 and 3 of their blocks.
    assert store.block_scale == (2, 3, 3)
    assert PagedKvStore.bytes_per_block(c, 4, torch.float32) == 768 * 4
    assert PagedKvStore.kv_shape(c, torch.float32).n_layers == 3
    assert store.layer_pool(3).data_ptr() == store.layer_pool(2).data_ptr()
    assert store.layer_pool(4).data_ptr() == store.layer_pool(1).data_ptr()
    unshared = load_model(gemma4_dirs["gemma4-plain"], device="cpu", dtype="float32").config
    assert unshared.kv_layers == tuple(range(5))
    assert PagedKvStore.kv_shape(unshared, torch.float32).n_layers == 5


def test_admission_prices_only_the_layers_that_write_kv(gemma4_dirs):
    model = load_model(gemma4_dirs["gemma4"], device="cpu", dtype="float32")
    store = model.decoder.new_store(4, num_blocks=64)
    pricing = store.groups.pricing(None)
    # Five layers, three of them writing K/V: one global group and two local ones, not two and three.
    assert (pricing.global_groups, pricing.local_groups) == (1, 2)
    hold = pricing.hold(20, 30, 4)
    assert hold.blocks == 3 * 8
    assert len(store.add_sequence("s", 30)) == hold.blocks == store.blocks_held()


def test_a_sliding_lease_decodes_as_a_lease_of_every_position(gemma4_dirs):
    model = load_model(gemma4_dirs["gemma4"], device="cpu", dtype="float32")
    ids = model.tokenizer.encode(PROMPTS[2])  # a short prompt and a long answer: sliding saves blocks
    total = len(ids) + 120
    runs = []
    for sliding in (False, True):
        store = model.decoder.new_store(4, num_blocks=256)
        policy = WindowPolicy(model.config.sliding_window, 4, 1) if sliding else None
        hold = store.groups.pricing(policy).hold(len(ids), total, 4)
        store.add_sequence("s", hold.held, window=hold.window, every=total)
        assert (store.seq("s").sliding is not None) == sliding
        steps = [model.decoder.forward([SeqChunk("s", ids)], store)[0]]
        for _ in range(total - len(ids) - 1):
            steps.append(model.decoder.forward([SeqChunk("s", [int(steps[-1].argmax())])], store)[0])
        runs.append(torch.stack(steps))
    assert torch.equal(runs[0], runs[1])


def test_the_groups_blocks_never_overlap(gemma4_dirs):
    # Every group's view of a block lies within that block's own memory, whatever its head shape.
    model = load_model(gemma4_dirs["gemma4"], device="cpu", dtype="float32")
    store = model.decoder.new_store(4, num_blocks=8)
    base = store.pools[0].untyped_storage().data_ptr()
    block_bytes = PagedKvStore.bytes_per_block(model.config, 4, torch.float32) // store.groups.size
    for pool, scale in zip(store.pools, store.block_scale):
        for block in range(8):
            first = pool[0, block * scale * 4]
            last = pool[0, block * scale * 4 + 3]
            start = first.data_ptr() - base
            end = last.data_ptr() - base + last.numel() * last.element_size()
            assert block * block_bytes <= start and end <= (block + 1) * block_bytes


def test_the_multimodal_checkpoint_is_served_as_its_text_model(tmp_path):
    folder = tiny_gemma4(tmp_path / "mm", "gemma4", multimodal=True)
    ours = load_model(folder, device="cpu", dtype="float32")
    assert ours.config.architecture == "Gemma4ForCausalLM"
    ref = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([ids])).logits[0, -1]
        assert_logits_close(prefill(ours, ids), want, widest(ours.config), len(ids), note=prompt)


def test_a_multimodal_config_without_a_text_model_is_refused_by_name():
    raw = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4"}
    with pytest.raises(ModelLoadError, match="Gemma4ForConditionalGeneration.*text_config"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_family_names_every_tensor_transformers_writes(gemma4_dirs, variant):
    from safetensors import safe_open

    from ferrox_batch.runtime.families.gemma4 import FAMILY
    folder = gemma4_dirs[variant]
    config = ModelConfig.from_file(folder / "config.json")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        written = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert FAMILY.tensors(config) == written


def test_a_checkpoint_of_the_familys_own_tensors_is_what_transformers_reads(tmp_path):
    # The generic fixture draws every tensor the family names: transformers must find each where it looks,
    # or it would draw the missing ones itself and the logits would part.
    from tiny_checkpoint import write_tiny_checkpoint
    folder = write_tiny_checkpoint(
        tmp_path / "g4", arch="gemma4_text", seed=3, layers=4, head_dim=16, std=0.2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        extra_config={"num_kv_shared_layers": 2, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 4,
                      "vocab_size_per_layer_input": 384, "attention_k_eq_v": True,
                      "num_global_key_value_heads": 1, "final_logit_softcapping": 20.0})
    ours, ref = load_model(folder, device="cpu", dtype="float32"), reference(folder)
    assert ours.config.kv_source == (0, 1, 0, 1)
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -1]
        assert_logits_close(prefill(ours, ids), want, widest(ours.config), len(ids), note=prompt)
