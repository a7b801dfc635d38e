"""The decoder on tiny random checkpoints: against transformers, and paged/chunked/batched self-consistency."""

from __future__ import annotations

import itertools

import pytest
import torch
from batch_helpers import greedy_ids as greedy
from numerics import assert_decisive, assert_logits_close

from ferrox_batch.errors import TokenOutOfVocab
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.loader import load_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Caf\u00e9 cr\u00e8me \U0001f680 and \u65e5\u672c\u8a9e",
    "def forward(self, x): return self.layers(x) + 1\nPaged attention stores keys",
    "a",
]


def reference(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def prefill_logits(model, ids, *, chunk=None, block_size=4, seq="s"):
    store = model.decoder.new_store(block_size, num_blocks=256)
    store.add_sequence(seq, len(ids) + 8)
    chunk = chunk or len(ids)
    logits = None
    for start in range(0, len(ids), chunk):
        logits = model.decoder.forward([SeqChunk(seq, ids[start:start + chunk])], store)
    return logits[0], store




#: Every tiny checkpoint: one per family and per switch a family has.
VARIANTS = ["llama", "llama-untied-llama3-rope", "qwen2", "mistral-window", "qwen3", "smollm3-nope", "gemma3",
            "phi3-longrope", "llama-linear-rope", "llama-dynamic-rope", "qwen3-yarn-rope", "granite", "olmo2"]
#: The mixture-of-experts checkpoints (their own tests: `test_moe_decoder`), against transformers here too.
MOE_VARIANTS = ["qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "mixtral-window", "gpt_oss"]
VARIANTS += MOE_VARIANTS


@pytest.mark.parametrize("variant", VARIANTS)
def test_last_logits_match_transformers_for_every_supported_variant(tiny_variant_dirs, variant, device):
    folder = tiny_variant_dirs[variant]
    ours = load_model(folder, device=device, dtype="float32")
    ref = reference(folder)
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        got, _ = prefill_logits(ours, ids)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -1]
        assert_logits_close(got, want, ours.config, len(ids), note=(variant, prompt))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in ("llama-untied-llama3-rope", "qwen2")])
def test_a_32_token_greedy_continuation_is_identical_to_transformers(tiny_variant_dirs, variant, device):
    folder = tiny_variant_dirs[variant]
    ours = load_model(folder, device=device, dtype="float32")
    ref = reference(folder)
    for prompt in PROMPTS[:3]:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )
        assert_decisive([step[0] for step in out.logits], ours.config, len(ids), note=(variant, prompt))
        assert greedy(ours, ids, 32) == out.sequences[0, len(ids):].tolist(), (variant, prompt)


def test_paged_decode_equals_a_full_sequence_forward(tiny_model):
    ids = tiny_model.tokenizer.encode(PROMPTS[2])
    full, _ = prefill_logits(tiny_model, ids)
    # Prefill all but the last token, then decode it one step at a time on a 3-position block size.
    store = tiny_model.decoder.new_store(3, num_blocks=64)
    store.add_sequence("x", len(ids))
    tiny_model.decoder.forward([SeqChunk("x", ids[:5])], store)
    for token in ids[5:]:
        step = tiny_model.decoder.forward([SeqChunk("x", [token])], store)
    assert_logits_close(step[0], full, tiny_model.config, len(ids))
    assert store.seq_len("x") == len(ids)


@pytest.mark.parametrize("chunk", [1, 2, 5, 11, 64])
def test_prefill_chunking_does_not_change_logits(tiny_model, chunk):
    ids = tiny_model.tokenizer.encode(PROMPTS[2] + " " + PROMPTS[0])
    one, _ = prefill_logits(tiny_model, ids)
    chunked, store = prefill_logits(tiny_model, ids, chunk=chunk)
    assert_logits_close(chunked, one, tiny_model.config, len(ids))
    assert store.seq_len("s") == len(ids)


@pytest.mark.parametrize("block_size,seed", [(1, 0), (4, 1), (16, 2), (5, 3)])
def test_any_schedule_of_mixed_chunks_gives_each_sequence_the_logits_it_gets_alone(
    tiny_model, block_size, seed
):
    """Random schedules: each forward mixes random-length prefill chunks and decodes of random sequences."""
    import random

    rng = random.Random(seed)
    streams = [tiny_model.tokenizer.encode(p) for p in PROMPTS]
    streams = [ids + ids[: rng.randint(1, 6)] for ids in streams]  # the tails play the decoded tokens
    alone = [prefill_logits(tiny_model, ids, block_size=block_size, seq=i)[0] for i, ids in enumerate(streams)]
    store = tiny_model.decoder.new_store(block_size, num_blocks=512)
    for i, ids in enumerate(streams):
        store.add_sequence(i, len(ids))
    cursor = [0] * len(streams)
    final: dict[int, torch.Tensor] = {}
    while len(final) < len(streams):
        live = [i for i in range(len(streams)) if cursor[i] < len(streams[i])]
        batch = []
        for i in rng.sample(live, rng.randint(1, len(live))):
            n = rng.choice([1, 1, 2, rng.randint(1, 12)])
            batch.append(SeqChunk(i, streams[i][cursor[i]:cursor[i] + n]))
            cursor[i] = min(cursor[i] + n, len(streams[i]))
        out = tiny_model.decoder.forward(batch, store)
        for chunk, row in zip(batch, out):
            if cursor[chunk.seq_id] == len(streams[chunk.seq_id]):
                final[chunk.seq_id] = row
    for i in range(len(streams)):
        assert store.seq_len(i) == len(streams[i])
        assert_logits_close(final[i], alone[i], tiny_model.config, len(streams[i]), note=i)


@pytest.mark.parametrize("variant", ["llama", "qwen3", "smollm3-nope", "gemma3", "phi3-longrope", "granite", "olmo2",
                                     *MOE_VARIANTS])
def test_a_batch_of_different_lengths_matches_each_sequence_alone(tiny_variant_dirs, variant, device):
    tiny_model = load_model(tiny_variant_dirs[variant], device=device, dtype="float32")
    enc = [tiny_model.tokenizer.encode(p) for p in PROMPTS]
    alone = [prefill_logits(tiny_model, ids)[0] for ids in enc]
    store = tiny_model.decoder.new_store(4, num_blocks=256)
    for i, ids in enumerate(enc):
        store.add_sequence(i, len(ids) + 1)
    together = tiny_model.decoder.forward([SeqChunk(i, ids) for i, ids in enumerate(enc)], store)
    for i in range(len(enc)):
        assert_logits_close(together[i], alone[i], tiny_model.config, len(enc[i]), note=i)
    # One decode step for all of them at once equals one decode step alone.
    nxt = [int(t.argmax()) for t in together]
    stepped = tiny_model.decoder.forward([SeqChunk(i, [nxt[i]]) for i in range(len(enc))], store)
    for i, ids in enumerate(enc):
        ref, _ = prefill_logits(tiny_model, ids + [nxt[i]])
        assert_logits_close(stepped[i], ref, tiny_model.config, len(ids) + 1, note=i)


@pytest.mark.parametrize("variant", ["llama", "mistral-window", "qwen3", "smollm3-nope", "gemma3", "phi3-longrope",
                                     "granite", "olmo2", "qwen2_moe"])
@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("kv", ["fp32", "fp16"])
def test_stale_pool_memory_never_reaches_the_logits(tiny_variant_dirs, device, variant, kernels, kv):
    """The store never clears a lease: whatever the pool held (NaN here) must not matter."""
    model = load_model(tiny_variant_dirs[variant], device=device, dtype="float32", kv_cache_dtype=kv)
    if not kernels:
        model.decoder.kernels = None  # the torch gather path, as on CUDA
    enc = [model.tokenizer.encode(p) for p in PROMPTS]  # different lengths: padded tables, masks

    def run(fill: float) -> torch.Tensor:
        store = model.decoder.new_store(4, num_blocks=96)
        store.kv.fill_(fill)
        for i, ids in enumerate(enc):
            store.add_sequence(i, len(ids) + 4)
        out = [model.decoder.forward([SeqChunk(i, ids) for i, ids in enumerate(enc)], store)]
        for step in range(4):
            out.append(model.decoder.forward([SeqChunk(i, [5 + step + i]) for i in range(len(enc))], store))
        return torch.cat(out)

    poisoned = run(float("nan"))
    assert bool(poisoned.isfinite().all())
    assert torch.equal(poisoned, run(0.0))


def test_decodes_and_prefills_interleave_in_one_forward(tiny_model):
    a = tiny_model.tokenizer.encode(PROMPTS[0])
    b = tiny_model.tokenizer.encode(PROMPTS[2])
    want_a, _ = prefill_logits(tiny_model, a)
    want_b, _ = prefill_logits(tiny_model, b)
    store = tiny_model.decoder.new_store(4, num_blocks=128)
    store.add_sequence("a", len(a))
    store.add_sequence("b", len(b))
    tiny_model.decoder.forward([SeqChunk("a", a[:-3])], store)
    got = {}
    chunks_of_b = [b[i:i + 5] for i in range(0, len(b), 5)]
    for step, piece in itertools.zip_longest(range(3), chunks_of_b):
        batch = [SeqChunk("b", piece)] if piece else []
        if step is not None:
            batch.append(SeqChunk("a", [a[len(a) - 3 + step]]))
        out = tiny_model.decoder.forward(batch, store)
        for chunk, row in zip(batch, out):
            got[chunk.seq_id] = row
    assert_logits_close(got["a"], want_a, tiny_model.config, len(a))
    assert_logits_close(got["b"], want_b, tiny_model.config, len(b))


def test_bf16_runs_and_stays_close_to_fp32(tiny_llama_dir, device):
    fp32 = load_model(tiny_llama_dir, device=device, dtype="float32")
    bf16 = load_model(tiny_llama_dir, device=device, dtype="bfloat16")
    ids = fp32.tokenizer.encode(PROMPTS[0])
    a, _ = prefill_logits(fp32, ids)
    b, _ = prefill_logits(bf16, ids)
    assert b.dtype == torch.float32
    # bf16's own roundings along the forward, against float32 (whose error counts too).
    assert_logits_close(b, a, fp32.config, len(ids), torch.bfloat16)


@pytest.mark.parametrize("kernels", [True, False])
def test_an_fp16_kv_cache_stays_close_to_fp32(tiny_llama_dir, device, kernels):
    """K and V rounded to fp16 once, when written; every read widens them back. The prefill (torch's
    SDPA over the gathered context) and the decode steps (the C kernel, or torch's gather) both read
    them, so the logits stay within fp16's own rounding along the forward of fp32's."""
    fp32 = load_model(tiny_llama_dir, device=device, dtype="float32")
    half = load_model(tiny_llama_dir, device=device, dtype="float32", kv_cache_dtype="fp16")
    if not kernels:  # both on torch's path: the same rotation before the store rounds it
        fp32.decoder.kernels = half.decoder.kernels = None
    ids = fp32.tokenizer.encode(PROMPTS[2])
    steps = [5, 17, 3, 250]

    def run(model):
        store = model.decoder.new_store(4, num_blocks=64)
        store.add_sequence(0, len(ids) + len(steps))
        out = [model.decoder.forward([SeqChunk(0, ids)], store)[0]]
        out += [model.decoder.forward([SeqChunk(0, [token])], store)[0] for token in steps]
        return out, store

    want, wide = run(fp32)
    got, narrow = run(half)
    assert narrow.kv.dtype == torch.float16
    for i, (a, b) in enumerate(zip(got, want)):
        assert_logits_close(a, b, fp32.config, len(ids) + i, torch.float16, note=f"step {i}")
    # The first layer's K and V come from identical inputs: the store holds exactly their fp16 rounding.
    slots = narrow.seq(0).table.repeat_interleave(4)[: len(ids) + len(steps)]
    slots = slots * 4 + torch.arange(len(slots)) % 4
    assert torch.equal(narrow.kv[0][slots], wide.kv[0][slots].half())


def test_a_token_outside_the_vocabulary_is_a_typed_error(tiny_model):
    store = tiny_model.decoder.new_store(4, num_blocks=8)
    store.add_sequence("s", 8)
    vocab = tiny_model.config.vocab_size
    with pytest.raises(TokenOutOfVocab) as err:
        tiny_model.decoder.forward([SeqChunk("s", [1, vocab + 3, 2])], store)
    assert err.value.token == vocab + 3 and err.value.vocab_size == vocab
    with pytest.raises(TokenOutOfVocab):
        tiny_model.decoder.forward([SeqChunk("s", [-1])], store)
    assert store.seq_len("s") == 0  # nothing was written


def test_an_empty_batch_or_chunk_is_a_clear_error(tiny_model):
    store = tiny_model.decoder.new_store(4, num_blocks=8)
    store.add_sequence("s", 8)
    with pytest.raises(ValueError, match="empty batch"):
        tiny_model.decoder.forward([], store)
    with pytest.raises(ValueError, match="empty chunk"):
        tiny_model.decoder.forward([SeqChunk("s", [])], store)
    with pytest.raises(ValueError, match="twice"):
        tiny_model.decoder.forward([SeqChunk("s", [1]), SeqChunk("s", [2])], store)
    with pytest.raises(KeyError, match="holds no KV"):
        tiny_model.decoder.forward([SeqChunk("nope", [1])], store)


def test_writing_past_a_sequences_lease_is_refused(tiny_model):
    store = tiny_model.decoder.new_store(4, num_blocks=8)
    store.add_sequence("s", 3)  # one block: 4 positions
    tiny_model.decoder.forward([SeqChunk("s", [1, 2, 3, 4])], store)
    with pytest.raises(ValueError, match="KV lease holds 4"):
        tiny_model.decoder.forward([SeqChunk("s", [5])], store)


def test_a_position_past_the_trained_context_is_refused(tiny_model):
    limit = tiny_model.config.max_position_embeddings
    store = tiny_model.decoder.new_store(16, num_blocks=limit // 16 + 2)
    store.add_sequence("long", limit + 1)
    store.add_sequence("short", 4)
    tiny_model.decoder.forward([SeqChunk("long", [1] * limit)], store)  # positions 0..limit-1: fine
    with pytest.raises(ValueError, match=f"position {limit} is past this model's {limit} trained positions"):
        tiny_model.decoder.forward([SeqChunk("short", [1]), SeqChunk("long", [2])], store)


def test_prefill_chunks_of_different_lengths_near_the_end_of_a_small_lease(tiny_model):
    """A short chunk at the end of a small lease beside a long chunk: padding must not index past its table."""
    a = tiny_model.tokenizer.encode(PROMPTS[0])[:8]
    b = tiny_model.tokenizer.encode(PROMPTS[2])[:12]
    want_a, _ = prefill_logits(tiny_model, a)
    want_b, _ = prefill_logits(tiny_model, b)
    store = tiny_model.decoder.new_store(4, num_blocks=16)
    store.add_sequence("a", 8)  # two blocks: exactly full after this forward
    store.add_sequence("b", 12)
    tiny_model.decoder.forward([SeqChunk("a", a[:6])], store)
    out = tiny_model.decoder.forward([SeqChunk("a", a[6:]), SeqChunk("b", b)], store)
    assert_logits_close(out[0], want_a, tiny_model.config, len(a))
    assert_logits_close(out[1], want_b, tiny_model.config, len(b))
