"""A model served from quantized weights: `/stats` says what its weights are and take, and it answers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_helpers import DEADLINE, served, stats, tiny_batcher

from ferrox_batch.runtime.loading.loader import load_model


@pytest.fixture(scope="module")
def quantized_server(tiny_batch_dir: Path):
    model = load_model(tiny_batch_dir, device="cpu", dtype="float32", weights="q8_0")
    batcher = tiny_batcher(model)
    with served(batcher) as (base_url, _app):
        yield base_url, model


def test_stats_report_the_weights_format_and_bytes(quantized_server) -> None:
    base_url, model = quantized_server
    seen = stats(base_url)
    assert seen["weight_formats"] == {"q8_0": 4 * len(model.decoder.layers) + 1}
    assert seen["weight_bytes"] == model.decoder.weight_bytes > 0
    assert seen["precision"] == "fp32"
    name = httpx.get(f"{base_url}/v1/models", timeout=DEADLINE).json()["data"][0]["id"]
    answer = httpx.post(f"{base_url}/v1/completions", json={"model": name, "prompt": "hello", "max_tokens": 5,
                                                             "ignore_eos": True}, timeout=DEADLINE)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
