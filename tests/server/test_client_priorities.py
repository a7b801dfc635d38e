"""Which `priority` a client may ask for is the server's to say (`create_app(client_priorities=)`).

Pins: by default a request may only use the default priority 0 (a multi-tenant server must not let one
client jump every queue); any other value is a 400 naming `priority` that says what this server allows;
a server configured with a range takes every value in it and refuses the rest; a malformed range is a
ValueError at `create_app`, and `serve --client-priorities MIN:MAX` parses into the same range.
"""

from __future__ import annotations

import argparse

import httpx
import pytest
from server_helpers import DEADLINE, served, tiny_batcher

from ferrox_batch.cli import build_parser
from ferrox_batch.server import create_app

BODY = {"prompt": "Hello", "max_tokens": 1, "temperature": 0, "ignore_eos": True}


def post(base_url: str, **extra) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", json={**BODY, **extra}, timeout=DEADLINE)


def test_by_default_only_the_default_priority_is_allowed(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model)) as (base_url, _app):
        assert post(base_url).status_code == 200
        assert post(base_url, priority=0).status_code == 200
        for value in (-1, 1, 5, -(2**31)):
            refused = post(base_url, priority=value)
            assert refused.status_code == 400, value
            error = refused.json()["error"]
            assert error["param"] == "priority" and "only priority 0" in error["message"], error


def test_a_configured_range_is_allowed_and_nothing_outside_it(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model), client_priorities=(-2, 3)) as (base_url, _app):
        for value in (-2, 0, 3):
            assert post(base_url, priority=value).status_code == 200, value
        for value in (-3, 4):
            error = post(base_url, priority=value).json()["error"]
            assert error["param"] == "priority" and "[-2, 3]" in error["message"], error
        chat = httpx.post(f"{base_url}/v1/chat/completions", timeout=DEADLINE, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": 9})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "priority"


@pytest.mark.parametrize("bad", [(1, 0), (0,), (0, 1.5), (True, 2), "0:1", (0, 2**31)])
def test_a_malformed_range_is_refused_at_create_app(tiny_batch_model, bad):
    batcher = tiny_batcher(tiny_batch_model)
    try:
        with pytest.raises(ValueError, match="client_priorities"):
            create_app(batcher, model_name="tiny", client_priorities=bad)
    finally:
        batcher.close(DEADLINE)


def test_the_serve_flag_parses_an_inclusive_range():
    def parse(*flags: str) -> argparse.Namespace:
        return build_parser().parse_args(["serve", *flags])

    assert parse().client_priorities == (0, 0)
    assert parse("--client-priorities", "0:10").client_priorities == (0, 10)
    assert parse("--client-priorities=-5:5").client_priorities == (-5, 5)
    assert parse("--client-priorities", "3").client_priorities == (3, 3)
    for bad in ("5:1", "a:b", "1:2:3", ":"):
        with pytest.raises(SystemExit):
            parse(f"--client-priorities={bad}")
