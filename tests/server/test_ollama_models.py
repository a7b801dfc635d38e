"""Ollama's model endpoints, embeddings and thinking through the official `ollama` client, on a server with a
reasoning parser and the chat page off.

Pins: `/api/tags` and `/api/ps` list the served model tagged `:latest`, with its size, a digest, its details
and (ps) its context length, loaded forever; `/api/show` answers the same details, the context and embedding
lengths, the capabilities (thinking with a reasoning parser) and the chat template, for the name with or
without `:latest`, and Ollama's 404 otherwise; `/api/version` and `HEAD /` answer what clients probe for,
while `GET /` stays a 404 with the page off; `/api/embed` is `/v1/embeddings` (normalised), `truncate`
deciding whether an input past the context is cut or refused, `dimensions` keeping the first values;
`/api/embeddings` is the unnormalised embedding of one prompt; an empty input is a load request; `think`
puts the reasoning parser's thinking in `message.thinking` (generate: `thinking`), whole and streamed.
"""

from __future__ import annotations

import math

import httpx
import ollama
import pytest
from server_helpers import DEADLINE, MODEL_NAME, openai_client, served, tiny_batcher

MESSAGES = [{"role": "user", "content": "Think."}]


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model), reasoning_parser="deepseek_r1", ui=False) as (base_url, app):
        yield base_url, app


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server[0], timeout=60)


def test_tags_and_ps_list_the_served_model_tagged(client, server):
    batcher = server[1].state.ferrox.batcher
    (listed,) = client.list().models
    assert listed.model == f"{MODEL_NAME}:latest" and listed.size == batcher.model_stats["weight_bytes"] > 0
    assert len(listed.digest) == 64 and int(listed.digest, 16) >= 0
    assert listed.details.format == "safetensors" and listed.details.quantization_level == "FP32"
    assert listed.details.family == "llama" and listed.details.parameter_size == ""
    (running,) = client.ps().models
    assert running.name == listed.model and running.digest == listed.digest
    assert running.context_length == batcher.ceiling.limit() and running.expires_at.year > 2100


@pytest.mark.parametrize("name", [MODEL_NAME, f"{MODEL_NAME}:latest"])
def test_show_answers_details_limits_capabilities_and_the_template(client, server, name):
    batcher = server[1].state.ferrox.batcher
    shown = client.show(name)
    assert shown.details == client.list().models[0].details
    family = shown.modelinfo["general.architecture"]
    assert family == "llama" == shown.details.family
    assert shown.modelinfo[f"{family}.context_length"] == batcher.ceiling.limit()
    assert shown.modelinfo[f"{family}.embedding_length"] == batcher.hidden_size
    assert shown.capabilities == ["completion", "tools", "thinking"]
    assert shown.template == (batcher.tokenizer.chat_template or "") and "temperature 0.8" in shown.parameters
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("nope:latest")
    assert missing.value.status_code == 404 and missing.value.error == "model 'nope:latest' not found"


def test_version_and_head_answer_what_clients_probe_while_get_stays_404_without_the_page(server):
    base_url = server[0]
    version = httpx.get(base_url + "/api/version", timeout=DEADLINE).json()["version"]
    assert [int(part) for part in version.split(".")] >= [0, 6, 0]
    assert httpx.head(base_url + "/", timeout=DEADLINE).status_code == 200
    assert httpx.get(base_url + "/", timeout=DEADLINE).status_code == 404


def embedded(base_url: str, **body) -> list[list[float]]:
    reply = httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL_NAME, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return [d["embedding"] for d in reply.json()["data"]]


def close(a: list[float], b: list[float]) -> bool:
    # The same float32 numbers, written and read back as JSON by both endpoints: equal to the digit.
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-12) for x, y in zip(a, b))


def test_embed_is_the_embeddings_endpoint_normalised(client, server):
    texts = ["The quick brown fox", "Paged attention"]
    got = client.embed(model=MODEL_NAME, input=texts)
    want = embedded(server[0], input=texts)
    assert all(close(a, b) for a, b in zip(got.embeddings, want)) and len(got.embeddings) == 2
    assert all(math.isclose(math.fsum(v * v for v in e), 1.0, rel_tol=1e-9) for e in got.embeddings)
    assert got.prompt_eval_count > 0 and got.total_duration > 0
    one = client.embed(model=MODEL_NAME, input="The quick brown fox", dimensions=8)
    assert close(one.embeddings[0], embedded(server[0], input="The quick brown fox", dimensions=8)[0])
    older = client.embeddings(model=MODEL_NAME, prompt="Paged attention").embedding
    assert close(older, embedded(server[0], input="Paged attention", normalize=False)[0])
    assert client.embed(model=MODEL_NAME, input=[]).embeddings == []


def test_truncate_decides_whether_a_long_input_is_cut_or_refused(client, server):
    limit = server[1].state.ferrox.batcher.ceiling.limit()
    long = "word " * (limit + 50)
    assert len(client.embed(model=MODEL_NAME, input=long).embeddings) == 1  # truncate defaults to true
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=MODEL_NAME, input=long, truncate=False)
    assert refused.value.status_code == 400


def test_think_puts_the_parsers_thinking_in_thinking(client, server):
    options = {"temperature": 0, "num_predict": 8}
    with openai_client(server[0]) as openai:
        want = openai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    thinking = want.choices[0].message.model_extra["reasoning_content"]
    whole = client.chat(model=MODEL_NAME, messages=MESSAGES, think=True, options=options)
    assert whole.message.thinking == thinking and whole.message.content == ""
    parts = list(client.chat(model=MODEL_NAME, messages=MESSAGES, think=True, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == thinking
    assert "".join(p.message.content for p in parts) == ""
    generated = client.generate(model=MODEL_NAME, prompt="Think.", think=True, options=options)
    assert generated.thinking == thinking and generated.response == ""
    # A template that has no switch for it thinks anyway: its thinking is still told apart.
    assert client.chat(model=MODEL_NAME, messages=MESSAGES, think=False, options=options).message.thinking == thinking


def test_a_show_body_past_its_small_cap_is_a_413_in_ollamas_shape(server):
    """`/api/show` is answered on the event loop: its body names a model, and a big one is refused unparsed."""
    from ferrox_batch.server.ollama.models import SHOW_MAX_BODY_BYTES

    big = {"model": MODEL_NAME, "pad": "x" * SHOW_MAX_BODY_BYTES}
    refused = httpx.post(f"{server[0]}/api/show", json=big, timeout=DEADLINE)
    assert refused.status_code == 413 and set(refused.json()) == {"error"}
    assert httpx.post(f"{server[0]}/api/show", json={"model": MODEL_NAME}, timeout=DEADLINE).status_code == 200
