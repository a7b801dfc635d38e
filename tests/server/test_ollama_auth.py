"""Ollama's routes on a server with an API key, through the official `ollama` client: the key as a bearer
token (the client's `headers`) or as `x-api-key` serves; none or a wrong one is a 401 in Ollama's shape, which
the client raises as a `ResponseError` with that status, before anything is read or generated."""

from __future__ import annotations

import httpx
import ollama
import pytest
from server_helpers import MODEL_NAME, served, tiny_batcher

KEY = "sk-ollama-7"
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 3}}


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model), api_key=KEY) as (base_url, _app):
        yield base_url


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}])
def test_the_key_in_either_header_serves(server, headers):
    client = ollama.Client(host=server, headers=headers, timeout=60)
    assert client.chat(**CHAT).message.role == "assistant"
    assert [m.model for m in client.list().models] == [f"{MODEL_NAME}:latest"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"}])
def test_no_key_or_a_wrong_one_is_a_401_in_ollamas_shape(server, headers):
    client = ollama.Client(host=server, headers=headers, timeout=60)
    for call in (lambda: client.chat(**CHAT), client.list, lambda: client.show(MODEL_NAME)):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 401 and "API key" in refused.value.error
    raw = httpx.post(f"{server}/api/chat", json=CHAT, headers=headers, timeout=60)
    assert raw.status_code == 401 and set(raw.json()) == {"error"}
