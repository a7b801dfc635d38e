"""The prefix cache on the real default model: an adopted prefix decodes as a computed one does.

What this file pins, in float32:

* a chat prompt whose system-prompt blocks were computed and published by another conversation gets, at
  every step of a 16-token greedy continuation, the logits of the same prompt computed from scratch (within
  `numerics.logits_tolerance`, the bound two float32 forwards that round differently stay within on any
  machine; measured on an AVX2 EPYC: identical, 0.0 apart) and the same tokens; every step of the cold run
  is decisive (`numerics.assert_decisive`), so the equality of tokens holds on any machine;
* a prompt cached whole (published with its answer) recomputes only its last partial block, and its
  first logits are again the cold ones;
* through the batcher, chat requests that share a system prompt report the adopted tokens in
  `usage.cached_tokens` and answer token for token what each answers with nothing cached.
"""

from __future__ import annotations

import threading

import pytest
import torch
from batch_helpers import greedy_params, spawn
from numerics import assert_decisive, assert_logits_close

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.loader import load_model

pytestmark = pytest.mark.real_model

BLOCK = 16
NEW_TOKENS = 16
SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about opening hours, bread, "
          "cakes and allergies in short, friendly sentences. The bakery opens at seven in the morning and "
          "closes at six in the evening, every day except Monday. All bread is baked on site, and the "
          "cakes contain nuts unless the label says otherwise.")
QUESTIONS = ["When do you open on Sunday?", "Do the cakes have nuts?", "Is the bread baked here?",
             "Can I order a birthday cake for Saturday?"]


@pytest.fixture(scope="module")
def model(real_model_dir, device):
    return load_model(real_model_dir, device=device, dtype="float32")


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    out = [model.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
           for q in QUESTIONS]
    shared = next(i for i, column in enumerate(zip(*out)) if len(set(column)) > 1)
    assert shared >= 4 * BLOCK, shared  # the system prompt spans several full blocks
    return out


def decode(model, store, seq, prompt: list[int], start: int) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill `prompt[start:]`, then greedy-decode NEW_TOKENS: each step's logits and token."""
    logits = model.decoder.forward([SeqChunk(seq, prompt[start:])], store)[0]
    steps, tokens = [], []
    for _ in range(NEW_TOKENS):
        steps.append(logits.detach().cpu().clone())
        tokens.append(int(logits.argmax()))
        logits = model.decoder.forward([SeqChunk(seq, [tokens[-1]])], store)[0]
    return steps, tokens


def cold(model, prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    store = model.decoder.new_store(BLOCK, num_blocks=64)
    store.add_sequence("cold", len(prompt) + NEW_TOKENS)
    return decode(model, store, "cold", prompt, 0)


def test_an_adopted_system_prompt_decodes_as_a_computed_one(model, prompts):
    target, other = prompts[0], prompts[1]
    want_logits, want_tokens = cold(model, target)
    assert_decisive(want_logits, model.config, len(target), note="cold")

    store = model.decoder.new_store(BLOCK, num_blocks=64, prefix_cache=True)
    store.add_sequence("other", len(other) + 1, other)
    for at in range(0, len(other), 24):  # the publisher's prefill runs in other chunks than the target's
        model.decoder.forward([SeqChunk("other", other[at:at + 24])], store)
    store.publish("other", other)
    store.free_sequence("other")

    store.add_sequence("warm", len(target) + NEW_TOKENS, target)
    adopted = store.seq_len("warm")
    assert adopted >= 4 * BLOCK and adopted % BLOCK == 0  # the shared system prompt's full blocks
    got_logits, got_tokens = decode(model, store, "warm", target, adopted)
    assert got_tokens == want_tokens
    for i, (got, want) in enumerate(zip(got_logits, want_logits)):
        assert_logits_close(got, want, model.config, len(target) + i, note=f"step {i}, {adopted} tokens adopted")

    # Published with its answer, the whole prompt is cached: only its last partial block is computed.
    store.publish("warm", target + got_tokens[:-1])
    store.free_sequence("warm")
    store.add_sequence("again", len(target) + 1, target)
    again = store.seq_len("again")
    assert again == (len(target) - 1) // BLOCK * BLOCK > adopted
    first = model.decoder.forward([SeqChunk("again", target[again:])], store)[0]
    assert_logits_close(first, want_logits[0], model.config, len(target), note="whole prompt cached")


def test_chat_requests_sharing_a_system_prompt_adopt_it_and_answer_as_computed(model, prompts):
    wants = []
    for prompt in prompts:
        logits, tokens = cold(model, prompt)
        assert_decisive(logits, model.config, len(prompt))
        wants.append(tuple(tokens))
    params = greedy_params(NEW_TOKENS, ignore_eos=True)
    config = BatcherConfig(kv_block_size=BLOCK, kv_blocks=128, prefix_cache=True)
    with spawn(model, config) as batcher:
        first = batcher.generate(prompts[0], params)  # publishes the system prompt
        assert first.token_ids == wants[0] and first.usage.cached_tokens == 0
        results: dict[int, object] = {}
        start = threading.Barrier(len(prompts) - 1)

        def go(k: int) -> None:
            start.wait(60)
            results[k] = batcher.generate(prompts[k], params)

        threads = [threading.Thread(target=go, args=(k,), daemon=True) for k in range(1, len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive()
        for k in range(1, len(prompts)):
            assert results[k].token_ids == wants[k], QUESTIONS[k]
            assert results[k].usage.cached_tokens >= 4 * BLOCK
        again = batcher.generate(prompts[0], params)  # now cached with its answer
        assert again.token_ids == wants[0]
        assert again.usage.cached_tokens == (len(prompts[0]) - 1) // BLOCK * BLOCK
        stats = batcher.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.prefix_cache_hits > 0
