"""`/v1/embeddings` through the official `openai` client and plain HTTP, against transformers' hidden states.

Pins: each input's embedding is its prompt's final hidden states (after the model's last norm) pooled,
`last` or `mean`, equal to transformers' float32 ones within the arithmetic's bound; normalised to unit
length by default; `dimensions` keeps the first k values; `base64` is the float32 bytes (what the
official client asks for by default, and decodes); a prompt longer than a prefill chunk, and one batched
beside generation, give the same embedding; the four input forms; bad fields are 400s naming them.
"""

from __future__ import annotations

import base64
import concurrent.futures
import math
import struct

import httpx
import pytest
import torch
from numerics import logits_tolerance
from server_helpers import MODEL_NAME, openai_client, served, tiny_batcher

TEXTS = ["The quick brown fox jumps over the lazy dog", "Paged attention", "a"]


@pytest.fixture(scope="module")
def embed_server(tiny_batch_model):
    # Small prefill chunks: the first text is prefilled over several forwards.
    with served(tiny_batcher(tiny_batch_model, prefill_chunk=8)) as (base_url, _app):
        yield base_url


@pytest.fixture(scope="module")
def reference(tiny_batch_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_batch_dir, dtype=torch.float32).eval()


def embed(base_url: str, **body) -> list[list[float]]:
    reply = httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL_NAME, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return [d["embedding"] for d in data]


def final_states(reference, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden states of `ids`: after the final norm, `[len(ids), hidden]`."""
    with torch.no_grad():
        out = reference(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].double()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_transformers_final_hidden_states_pooled(embed_server, reference, tiny_batch_model, pooling):
    ids = [tiny_batch_model.tokenizer.encode(t) for t in TEXTS]
    got = embed(embed_server, input=TEXTS, pooling=pooling, normalize=False)
    for row, tokens in zip(got, ids):
        states = final_states(reference, tokens)
        want = states[-1] if pooling == "last" else states.mean(dim=0)
        tolerance = logits_tolerance(tiny_batch_model.config, len(tokens), states)
        assert len(row) == tiny_batch_model.config.hidden_size
        assert float((torch.tensor(row, dtype=torch.float64) - want).abs().max()) <= tolerance


def test_normalised_truncated_and_base64(embed_server):
    raw = embed(embed_server, input=TEXTS[1], normalize=False)[0]
    unit = embed(embed_server, input=TEXTS[1])[0]
    # The same float64 steps the server takes: an exactly rounded sum of squares, its root, a division each.
    norm = math.sqrt(math.fsum(v * v for v in raw))
    assert unit == [v / norm for v in raw]
    short = embed(embed_server, input=TEXTS[1], dimensions=8)[0]
    head = math.sqrt(math.fsum(v * v for v in raw[:8]))
    assert short == [v / head for v in raw[:8]]
    packed = embed(embed_server, input=TEXTS[1], encoding_format="base64")[0]
    as_float32 = struct.unpack(f"<{len(unit)}f", struct.pack(f"<{len(unit)}f", *unit))  # each rounded once
    assert struct.unpack(f"<{len(unit)}f", base64.b64decode(packed)) == as_float32
    with openai_client(embed_server) as client:  # asks for base64 itself, and decodes it
        reply = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.usage.prompt_tokens > 0
    assert tuple(reply.data[1].embedding) == as_float32


def test_every_input_form_and_company_change_nothing(embed_server, tiny_batch_model):
    ids = [tiny_batch_model.tokenizer.encode(t) for t in TEXTS]
    alone = [embed(embed_server, input=t)[0] for t in TEXTS]
    assert embed(embed_server, input=ids) == embed(embed_server, input=TEXTS)
    assert embed(embed_server, input=ids[0])[0] == alone[0]

    def generate(i: int) -> None:
        httpx.post(f"{embed_server}/v1/completions", json={"prompt": f"Count to {i}", "max_tokens": 24,
                                                           "ignore_eos": True}, timeout=60).raise_for_status()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        busy = [pool.submit(generate, i) for i in range(3)]
        together = [pool.submit(embed, embed_server, input=t) for t in TEXTS]
        rows = [f.result()[0] for f in together]
        for f in busy:
            f.result()
    for row, single, tokens in zip(rows, alone, ids):
        # Other rows in the forward change only the order of float32 roundings.
        tolerance = logits_tolerance(tiny_batch_model.config, len(tokens), torch.tensor(single))
        assert max(abs(a - b) for a, b in zip(row, single)) <= tolerance


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({}, "input"), ({"input": [[]]}, "input[0]"),
    ({"input": ["x"] * 65}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "dimensions": 10**6}, "dimensions"),
    ({"input": "x", "pooling": "cls"}, "pooling"), ({"input": "x", "normalize": "yes"}, "normalize"),
    ({"input": "x", "model": "other"}, "model"), ({"input": [10**9]}, "token_out_of_vocab"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_embedding_requests_are_400s(embed_server, body, param):
    reply = httpx.post(f"{embed_server}/v1/embeddings", json=body, timeout=30)
    error = reply.json()["error"]
    assert reply.status_code in (400, 404) and param in (error.get("param"), error.get("code")), reply.text
