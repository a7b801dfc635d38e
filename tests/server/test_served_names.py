"""`--served-model-name` (one name or several) and `/v1/models` with `max_model_len`.

Pins: every name is listed, each with the longest prompt + output a request may have; a request may name
any of them and its answer carries the name it asked for (the first when it names none); another name is
a 404 `model_not_found` listing the served ones; the flag takes several names, `--model-name` is its
older spelling; `create_app` refuses empty or repeated names.
"""

from __future__ import annotations

import httpx
import pytest
from server_helpers import openai_client, running_server, tiny_batcher

from ferrox_batch.cli import build_parser
from ferrox_batch.server.app import create_app

NAMES = ("smol", "smol-alias")


@pytest.fixture(scope="module")
def named_server(tiny_batch_model):
    batcher = tiny_batcher(tiny_batch_model)
    try:
        with running_server(create_app(batcher, model_name=NAMES)) as base_url:
            yield base_url, batcher
    finally:
        assert batcher.close(10)


def test_every_name_is_listed_and_answered_under_its_own_name(named_server):
    base_url, batcher = named_server
    with openai_client(base_url) as client:
        models = client.models.list().data
        assert [m.id for m in models] == list(NAMES)
        assert all(m.model_extra["max_model_len"] == batcher.ceiling.limit() for m in models)
        for name in NAMES:
            reply = client.completions.create(model=name, prompt="Hi", max_tokens=2)
            assert reply.model == name
            chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=2)
            assert chat.model == name
    unnamed = httpx.post(f"{base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30).json()
    assert unnamed["model"] == NAMES[0]
    other = httpx.post(f"{base_url}/v1/completions", json={"model": "other", "prompt": "Hi"}, timeout=30)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert all(name in other.json()["error"]["message"] for name in NAMES)


def test_the_flag_takes_several_names_and_keeps_its_older_spelling():
    assert build_parser().parse_args(["serve", "--served-model-name", "a", "b"]).model_name == ["a", "b"]
    assert build_parser().parse_args(["serve", "--model-name", "a"]).model_name == ["a"]
    assert build_parser().parse_args(["serve"]).model_name is None


@pytest.mark.parametrize("names", [(), ("",), ("a", "a"), [3]])
def test_bad_names_are_refused(tiny_batch_model, names):
    batcher = tiny_batcher(tiny_batch_model)
    try:
        with pytest.raises(ValueError, match="model_name"):
            create_app(batcher, model_name=names)
    finally:
        assert batcher.close(10)
