"""An evaluation harness's scores from the server equal the model's: the multiple-choice task that ships in
`scripts/eval/`, scored over HTTP as `lm-eval`'s `local-completions` model scores it, against
transformers in float32.

`lm-eval` tokenizes each question and answer itself and sends `{"prompt": [[ids]], "echo": true,
"max_tokens": 1, "logprobs": 1, "temperature": 0}` (with `tokenized_requests=True`), then sums
`token_logprobs[ctxlen:-1]`, the answer's tokens. Here each question's answers go as one request of
several token-id prompts (what it sends with a batch size above one), and a few as strings, which must
score the same. Each answer's summed log-probability is within the sum of its tokens' bounds of
transformers' (a log-probability is a logit less the log-sum-exp: twice the logits' tolerance of two
float32 forwards, `numerics`), and where the best answer beats the next by more than both bounds, both
pick it. Also pinned: vLLM's `prompt_logprobs` gives the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from numerics import logits_tolerance
from server_helpers import MODEL_NAME, served

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.runtime.loading.loader import load_model

pytestmark = pytest.mark.real_model

TASK = Path(__file__).resolve().parents[2] / "scripts" / "eval" / "ferrox_mc.jsonl"


@pytest.fixture(scope="module")
def model(real_model_dir, device):
    return load_model(real_model_dir, device=device, dtype="float32")


@pytest.fixture(scope="module")
def reference(real_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: the whole text's ids, the context's, and the rest as the continuation's."""
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def test_multiple_choice_scores_equal_transformers(model, reference):
    docs = [json.loads(line) for line in TASK.read_text().splitlines()]
    batcher = ContinuousBatcher.from_model(model, BatcherConfig(kv_block_size=16, kv_blocks=512))
    agree = 0
    with served(batcher) as (base_url, _app), httpx.Client(base_url=base_url, timeout=120) as http:
        for number, doc in enumerate(docs):
            context = f"Question: {doc['question']}\nAnswer:"
            pairs = [encode_pair(model.tokenizer, context, " " + choice) for choice in doc["choices"]]
            body = {"model": MODEL_NAME, "prompt": [c + a for c, a in pairs], "echo": True, "max_tokens": 1,
                    "logprobs": 1, "temperature": 0}
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            choices = reply.json()["choices"]
            assert [c["index"] for c in choices] == list(range(len(pairs)))
            ours, theirs, bounds = [], [], []
            for (ctx, answer), choice in zip(pairs, choices):
                got = choice["logprobs"]["token_logprobs"][len(ctx):-1]
                assert len(got) == len(answer)
                with torch.no_grad():
                    logits = reference(torch.tensor([ctx + answer])).logits[0]
                want = logits.double().log_softmax(-1)
                rows = range(len(ctx) - 1, len(ctx) + len(answer) - 1)
                ours.append(sum(got))
                theirs.append(sum(float(want[r, t]) for r, t in zip(rows, answer)))
                bounds.append(sum(2 * logits_tolerance(model.config, r + 1, logits[r]) for r in rows))
            for a, b, bound in zip(ours, theirs, bounds):
                assert abs(a - b) <= bound, (doc["question"], a, b, bound)
            ranked = sorted(range(len(ours)), key=lambda i: -theirs[i])
            if theirs[ranked[0]] - theirs[ranked[1]] > bounds[ranked[0]] + bounds[ranked[1]]:
                assert max(range(len(ours)), key=lambda i: ours[i]) == ranked[0]
                agree += 1
            if number % 8 == 0:  # the same answers as text, and through vLLM's prompt_logprobs
                texts = [context + " " + choice for choice in doc["choices"]]
                as_text = http.post("/v1/completions", json={**body, "prompt": texts}).json()["choices"]
                assert [c["logprobs"]["token_logprobs"] for c in as_text] == \
                    [c["logprobs"]["token_logprobs"] for c in choices]
                scored = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": texts[0],
                                                            "max_tokens": 1, "prompt_logprobs": 0}).json()
                entries = scored["choices"][0]["prompt_logprobs"]
                ids = pairs[0][0] + pairs[0][1]
                assert [None] + [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])] == \
                    choices[0]["logprobs"]["token_logprobs"][:len(ids)]
    assert agree >= len(docs) // 2  # the check above ran on most questions, not on none
