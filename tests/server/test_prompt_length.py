"""Prompts are tokenized without stalling the event loop, and refused unread when too long to ever fit.

* The character bound: a text of C characters encodes to at least ceil(C / m) ids, m being the most
  characters one token can stand for (`Tokenizer.max_token_chars`); a prompt longer than `limit * m`
  characters is refused with the context ceiling's own 400 before the tokenizer sees it.
* Tokenizing releases the GIL: a prompt that takes a second to tokenize leaves `/health` answering.
* `/tokenize` and `/detokenize` have their own open-request cap (503 `server_busy` past it).
"""

from __future__ import annotations

import math
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import DEADLINE, MODEL_NAME, poll, served, tiny_batcher
from tiny_checkpoint import SPECIAL_TOKENS, write_tiny_checkpoint

from ferrox_batch.request_caps import RequestCaps
from ferrox_batch.runtime.loading.tokenizer import Tokenizer

#: Texts mixing the special tokens' literal spellings with arbitrary characters (multi-byte ones too).
TEXTS = st.lists(st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL_TOKENS),
                           st.text(alphabet=" \n\t", max_size=20)), max_size=8).map("".join)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_batch_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_batch_dir)


@pytest.fixture(scope="module")
def real_tokenizer(real_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(real_model_dir)


class Counting:
    """Stands in for the `tokenizers` object and counts the encodes it is asked for."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.encodes = 0

    def __getattr__(self, name: str):
        attribute = getattr(self._inner, name)
        if name.startswith("encode"):
            def counted(*args, **kwargs):
                self.encodes += 1
                return attribute(*args, **kwargs)
            return counted
        return attribute


def test_the_bound_is_the_longest_token_for_byte_level_bpe(tiny_tokenizer, real_tokenizer):
    for tok in (tiny_tokenizer, real_tokenizer):
        longest = max(len(t) for t in tok.inner.get_vocab(with_added_tokens=True))
        assert tok.max_token_chars == longest
    assert real_tokenizer.max_token_chars == 81  # SmolLM2: "\n" and 80 spaces is one token


@settings(max_examples=200, deadline=None)
@given(text=TEXTS)
def test_no_text_encodes_to_fewer_ids_than_the_bound_promises(tiny_tokenizer, real_tokenizer, text):
    for tok in (tiny_tokenizer, real_tokenizer):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) >= tok.least_tokens(text)
        kept = [ch for ch in text if ch not in tok.length_bound.dropped]
        assert tok.least_tokens(text) == math.ceil(len(kept) / tok.max_token_chars)


def test_characters_the_tokenizer_drops_are_not_counted(real_tokenizer):
    # SmolLM2's byte-level vocabulary has no symbol for a few control bytes: it skips those characters.
    assert "\x04" in real_tokenizer.length_bound.dropped
    assert real_tokenizer.encode("\x04" * 1000, add_special_tokens=False) == []
    assert real_tokenizer.least_tokens("\x04" * 1000) == 0
    assert real_tokenizer.least_tokens("\x04" * 1000 + "a") == 1


@settings(max_examples=200, deadline=None)
@given(text=TEXTS)
def test_encode_gives_the_ids_the_tokenizer_library_gives(real_tokenizer, text):
    assert real_tokenizer.encode(text, add_special_tokens=False) == real_tokenizer.inner.encode(
        text, add_special_tokens=False).ids


def test_a_tokenizer_that_can_shrink_text_has_no_bound(tiny_tokenizer):
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    def built(configure) -> Tokenizer:
        inner = HfTokenizer.from_str(tiny_tokenizer.inner.to_str())
        configure(inner)
        return Tokenizer(inner)

    def whitespace_dropped(inner):
        inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def stripped(inner):
        inner.normalizer = normalizers.Strip()

    def word_level(inner):
        inner.model = models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")

    for configure in (whitespace_dropped, stripped, word_level):
        tok = built(configure)
        assert tok.max_token_chars is None and tok.least_tokens("x" * 10_000) == 0


# ------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def small_context(tiny_batch_model):
    """The tiny checkpoint (512 positions) behind a tokenization cap of one."""
    with served(tiny_batcher(tiny_batch_model), max_concurrent_tokenizations=1) as (base_url, app):
        yield base_url, app


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(small_context):
    base_url, app = small_context
    tokenizer = app.state.ferrox.generations.tokenizer
    limit = app.state.ferrox.batcher.ceiling.limit()
    longest = limit * tokenizer.max_token_chars
    counting = Counting(tokenizer.inner)
    tokenizer.inner = counting
    try:
        too_long = "a" * (longest + 1)
        requests = [("/v1/completions", {"model": MODEL_NAME, "prompt": too_long, "max_tokens": 1}),
                    ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 1,
                                              "messages": [{"role": "user", "content": too_long}]})]
        for path, body in requests:
            refused = httpx.post(base_url + path, json=body, timeout=DEADLINE)
            assert refused.status_code == 400, (path, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["positions_limit"] == limit, error
            assert "prompt is too long" in error["message"]
        assert counting.encodes == 0
        # At the bound the text may still fit: it is tokenized (and then counted exactly).
        at_bound = httpx.post(base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "a" * longest,
                                                                  "max_tokens": 1}, timeout=DEADLINE)
        assert at_bound.status_code in (200, 400) and counting.encodes == 1
        # `/tokenize` counts whatever it is sent: a client counting a text it means to truncate gets the count.
        counted = httpx.post(base_url + "/tokenize", json={"prompt": too_long}, timeout=DEADLINE)
        assert counted.status_code == 200 and counted.json()["count"] > limit
    finally:
        tokenizer.inner = counting._inner


def test_tokenize_past_its_open_request_cap_is_503(small_context):
    base_url, app = small_context
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=DEADLINE) as slow:
        # Holds the one slot: headers sent, the body promised and never finished.
        slow.sendall(b"POST /tokenize HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        poll(lambda: app.state.ferrox.tokenizations_open == 1, "the slow upload to hold the slot")
        busy = httpx.post(base_url + "/tokenize", json={"prompt": "hi"}, timeout=DEADLINE)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
        assert busy.headers["retry-after"] == "1"
        assert httpx.post(base_url + "/detokenize", json={"tokens": [1]}, timeout=DEADLINE).status_code == 503
        # Generation has its own cap: not refused.
        assert httpx.post(base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                          timeout=DEADLINE).status_code == 200
    poll(lambda: app.state.ferrox.tokenizations_open == 0, "the slot to come back")
    assert httpx.post(base_url + "/tokenize", json={"prompt": "hi"}, timeout=DEADLINE).status_code == 200


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory):
    """A tiny checkpoint with a context long enough that a ~2M-character prompt passes the bound."""
    from ferrox_batch.runtime.loading.loader import load_model

    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("long-context"), max_positions=1 << 18)
    model = load_model(folder, device="cpu", dtype="float32")
    # The prompt tokenizes to about 440k ids: more than `/tokenize` answers by default (`request_caps`).
    with served(tiny_batcher(model), request_caps=RequestCaps(max_tokenization_ids=1 << 20)) as (base_url, app):
        yield base_url, app


def test_health_answers_while_a_huge_prompt_is_tokenized(long_context):
    base_url, app = long_context
    tokenizer = app.state.ferrox.generations.tokenizer
    prompt = "The quick brown fox jumps over the lazy dog. " * 44_000  # ~2M characters
    assert len(prompt) <= app.state.ferrox.batcher.ceiling.limit() * tokenizer.max_token_chars
    started = time.perf_counter()
    expected = len(tokenizer.inner.encode(prompt, add_special_tokens=False).ids)
    tokenize_secs = time.perf_counter() - started  # what the server spends in the tokenizer for it

    answer: dict = {}

    def tokenize() -> None:
        answer["response"] = httpx.post(base_url + "/tokenize", json={"prompt": prompt}, timeout=6 * DEADLINE)

    worker = threading.Thread(target=tokenize)
    with httpx.Client(timeout=DEADLINE) as http:
        http.get(base_url + "/health")  # the connection is open before the clock starts
        worker.start()
        # The longest time between two answers: the server shares this process, so a tokenizer holding
        # the GIL stalls this thread too, and only the gap between answers shows it wherever it falls.
        worst, polls, last = 0.0, 0, time.perf_counter()
        while worker.is_alive():
            assert http.get(base_url + "/health").status_code == 200
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
            polls += 1
            time.sleep(0.01)
        worker.join()
    assert answer["response"].status_code == 200
    assert expected <= answer["response"].json()["count"] <= expected + 1  # with or without a BOS
    # Holding the GIL, the tokenizer froze the loop for all of `tokenize_secs` (about 2 s here); a
    # quarter of it is a generous allowance for a loaded machine.
    assert polls >= 3 and worst < tokenize_secs / 4, (worst, tokenize_secs, polls)
