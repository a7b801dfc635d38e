"""The default real model (SmolLM2-135M-Instruct, fetched by `make test`) against transformers."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_decisive, assert_logits_close, logits_tolerance

from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.fetch import default_gguf_path
from ferrox_batch.runtime.loading.loader import load_model

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Continuous batching lets a server",
]


@pytest.fixture(scope="module")
def ours(real_model_dir, device):
    return load_model(real_model_dir, device=device, dtype="float32")


@pytest.fixture(scope="module")
def reference(real_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()


def run_prompt(model, ids, new_tokens=0):
    store = model.decoder.new_store(16, num_blocks=64)
    store.add_sequence(0, len(ids) + new_tokens)
    logits = model.decoder.forward([SeqChunk(0, ids)], store)
    first = logits[0].cpu()
    out = []
    for _ in range(new_tokens):
        out.append(int(logits[0].argmax()))
        logits = model.decoder.forward([SeqChunk(0, [out[-1]])], store)
    return first, out


def test_final_logits_agree_with_transformers(ours, reference):
    for prompt in PROMPTS + [ours.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])]:
        ids = ours.tokenizer.encode(prompt)
        got, _ = run_prompt(ours, ids)
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0, -1]
        assert_logits_close(got, want, ours.config, len(ids), note=prompt)


def test_a_32_token_greedy_continuation_is_identical(ours, reference):
    chat = ours.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    for ids in (ours.tokenizer.encode(PROMPTS[0]), chat):
        _, got = run_prompt(ours, ids, 32)
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2,
                output_logits=True, return_dict_in_generate=True,
            )
        assert_decisive([step[0] for step in out.logits], ours.config, len(ids))
        assert got == out.sequences[0, len(ids):].tolist()


def test_the_chat_template_and_stop_tokens_come_from_the_checkpoint(ours):
    text = ours.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ours.tokenizer.stop_tokens.ids == {ours.tokenizer.token_to_id("<|im_end|>"),
                                              ours.tokenizer.token_to_id("<|endoftext|>")}


def test_the_gguf_loads_directly_and_gives_the_folders_logits(ours, real_model_dir):
    gguf_path = default_gguf_path(real_model_dir.parent.parent)
    # The weight-only kernel: the file's weights exactly (the default int8 kernel also rounds the
    # activations, which the quality tests bound).
    direct = load_model(gguf_path, device=ours.decoder.device, dtype="float32", int8_activations=False)
    ids = ours.tokenizer.encode(PROMPTS[1])
    assert direct.tokenizer.encode(PROMPTS[1]) == ids
    a, _ = run_prompt(ours, ids)
    b, _ = run_prompt(direct, ids)
    # The same weights, but the folder's are read in place from its safetensors file (8-byte aligned)
    # and the GGUF's are fresh 64-byte aligned tensors, and the BLAS blocks its sums by alignment: two
    # float32 forwards that round in different orders, not the same bits.
    assert_logits_close(a, b, ours.config, len(ids))


def test_generated_logprobs_agree_with_transformers_log_softmax(ours, reference):
    # What a scoring client reads: each generated token's log-probability and the top 5, from the batcher,
    # against transformers' log_softmax over the same prefix (one forward of the whole sequence there, a
    # prefill and decode steps here). A log-probability is a logit less the log-sum-exp, so the two are
    # within twice the logits' tolerance of two float32 forwards (`numerics`). Measured on an AVX2 EPYC:
    # at most 8.2e-5 over 72 tokens of three chat prompts.
    from ferrox_batch.admission.config import BatcherConfig
    from ferrox_batch.engine.handle import ContinuousBatcher
    from ferrox_batch.generation_types import GenerationParams

    ids = ours.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers."}])
    with ContinuousBatcher.from_model(ours, BatcherConfig(kv_block_size=16, kv_blocks=64)) as batcher:
        result = batcher.generate(ids, GenerationParams(max_tokens=12, ignore_eos=True, logprobs=5))
    with torch.no_grad():
        logits = reference(torch.tensor([ids + list(result.token_ids)])).logits[0]
    for i, entry in enumerate(result.logprobs):
        step = logits[len(ids) - 1 + i]
        want = step.double().log_softmax(-1)
        tolerance = 2 * logits_tolerance(ours.config, len(ids) + i, step)
        assert abs(entry.logprob - float(want[entry.token])) <= tolerance, (i, entry.logprob, float(want[entry.token]))
        best = want.topk(5).values.tolist()
        assert all(abs(v - w) <= tolerance for (_, v), w in zip(entry.top, best)), (i, entry.top, best)
        assert all(abs(v - float(want[t])) <= tolerance for t, v in entry.top)
