"""The HTTP server driven by the official `openai` client: completions, chat, streaming, stop, seeds, concurrency.

A real uvicorn server on 127.0.0.1 (free port) serves the tiny checkpoint;
answers are checked against the same batcher called directly, so the server
is shown to add and lose nothing. One test serves the real default model
(`real_model`), and one runs `serve` itself end to end.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import httpx
import pytest
from conftest import TEST_DEVICE
from server_helpers import DEADLINE, GREEDY, MODEL_NAME, openai_client, poll, served, stats

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.server import serve

PROMPTS = ["The quick brown fox", "Paged attention stores", "Continuous batching keeps", "def forward(self, x):"]


def direct(batcher: ContinuousBatcher, prompt, max_tokens: int, **options) -> str:
    return batcher.generate_text(prompt, max_tokens=max_tokens, ignore_eos=True, **options).text


def test_models_lists_the_one_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model"


def test_completion_is_the_batchers_answer(server, client):
    _base_url, batcher = server
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=10, **GREEDY)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and reply.model == MODEL_NAME
    assert choice.text == direct(batcher, PROMPTS[0], 10)
    assert choice.finish_reason == "length"
    prompt_tokens = len(batcher.tokenizer.encode(PROMPTS[0]))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 10)
    assert reply.usage.total_tokens == prompt_tokens + 10


def test_chat_renders_the_checkpoint_template(server, client):
    _, batcher = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, **GREEDY)
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == direct(batcher, messages, 8)
    assert reply.usage.prompt_tokens == len(batcher.tokenizer.encode_chat(messages))


def test_streamed_completion_adds_up_to_the_whole_answer(server, client):
    _, batcher = server
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text_chunks, final, usage = chunks[:-2], chunks[-2], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == direct(batcher, PROMPTS[2], 12)
    assert all(c.choices[0].finish_reason is None for c in text_chunks)
    assert final.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_opens_with_the_assistant_role(server, client):
    _, batcher = server
    messages = [{"role": "user", "content": PROMPTS[3]}]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, stream=True,
                                                 **GREEDY))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == direct(batcher, messages, 8)


def test_stop_string_ends_the_answer_before_it(server, client):
    _, batcher = server
    full = direct(batcher, PROMPTS[0], 16)
    at = next(i for i in range(2, len(full) - 1) if full[i:i + 2].isalnum())
    stop = full[at:at + 2]
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, stop=[stop], **GREEDY)
    assert reply.choices[0].text == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, stop=stop,
                                         stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


def test_a_seed_reproduces_a_sampled_answer(client):
    def sample(seed: int) -> str:
        reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=1.0,
                                          seed=seed, extra_body={"ignore_eos": True})
        return reply.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3, 4)}) > 1


def test_defaults_and_token_id_prompts(server):
    base_url, batcher = server
    ids = batcher.tokenizer.encode(PROMPTS[0])
    with httpx.Client(base_url=base_url, timeout=DEADLINE) as http:
        # No model, no max_tokens: OpenAI's default of 16 tokens.
        body = http.post("/v1/completions", json={"prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True}).json()
        assert body["usage"]["completion_tokens"] == 16
        by_ids = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True}).json()
        one_string = http.post("/v1/completions", json={"prompt": [PROMPTS[0]], "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True}).json()
    assert by_ids["choices"][0]["text"] == one_string["choices"][0]["text"] == direct(batcher, PROMPTS[0], 6)
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_32_concurrent_streaming_clients_all_complete(server, client):
    _, batcher = server
    expected = {p: direct(batcher, p, 12) for p in PROMPTS}

    def stream(i: int) -> tuple[str, str, int]:
        prompt = PROMPTS[i % len(PROMPTS)]
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-2].choices[0].finish_reason == "length"
        return prompt, text, chunks[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(stream, range(32), timeout=60))
    assert len(results) == 32
    for prompt, text, generated in results:
        assert text == expected[prompt]
        assert generated == 12


def test_health_and_stats(server):
    base_url, batcher = server
    health = httpx.get(f"{base_url}/health", timeout=DEADLINE)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    body = stats(base_url)
    # the batcher's counters, and what the server adds about the model it serves
    assert set(body) == set(batcher.stats().to_dict()) | {"precision", "weight_bytes", "weight_formats",
                                                          "batch_invariant"}
    assert body["worker_alive"] is True and body["kv_blocks_total"] == 256
    assert set(body["weight_formats"]) == {"dense"} and body["weight_bytes"] > 0  # a dense fp32 checkpoint
    assert body["batch_invariant"] is False  # fp32 dense linears run oneDNN's kernels


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_runs_until_stopped_and_closes_everything(tiny_batch_dir):
    before = set(threading.enumerate())
    port = _free_port()
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            serve(tiny_batch_dir, BatcherConfig(kv_block_size=16, kv_blocks=64), "127.0.0.1", port,
                  model_name=MODEL_NAME, device=TEST_DEVICE, dtype="float32", log_level="warning", stop=stop)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=run, name="test-serve", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    poll(up, "serve() to answer /health", timeout=60)
    with openai_client(base_url) as c:
        assert c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, **GREEDY).usage.completion_tokens == 3
    stop.set()
    thread.join(DEADLINE)
    assert not thread.is_alive() and not errors
    deadline = time.monotonic() + DEADLINE
    while [t for t in set(threading.enumerate()) - before if t.is_alive()] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in set(threading.enumerate()) - before], "serve() left threads running"


@pytest.mark.real_model
def test_real_model_answers_a_chat(real_model_dir):
    from ferrox_batch.runtime.loading.loader import load_model

    model = load_model(real_model_dir, device=TEST_DEVICE, dtype="float32")
    batcher = ContinuousBatcher.from_model(model, BatcherConfig(kv_block_size=16, kv_blocks=256))
    with served(batcher) as (base_url, _app), openai_client(base_url, timeout=120) as c:
        reply = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "What is 2+2?"}],
                                          max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 5 and 0 < reply.usage.completion_tokens <= 24


def test_the_prefix_cache_reports_cached_tokens_and_honours_cache_salt(tiny_batch_model):
    # A repeated prompt is served from the prefix cache: the second answer says how many prompt tokens
    # it did not compute (OpenAI's `usage.prompt_tokens_details.cached_tokens`), /metrics carries vLLM's
    # counters, and another `cache_salt` shares nothing.
    import httpx
    from server_helpers import served

    from ferrox_batch.admission.config import BatcherConfig
    from ferrox_batch.engine.handle import ContinuousBatcher

    batcher = ContinuousBatcher.from_model(
        tiny_batch_model, BatcherConfig(kv_block_size=16, kv_blocks=256, prefix_cache=True))
    prompt = list(range(5, 45))  # 40 token ids: two full blocks can be adopted
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with served(batcher) as (base_url, _app):
        def usage(extra: dict) -> dict:
            response = httpx.post(f"{base_url}/v1/completions", json={**body, **extra}, timeout=30)
            assert response.status_code == 200, response.text
            return response.json()["usage"]

        assert usage({})["prompt_tokens_details"] == {"cached_tokens": 0}
        assert usage({})["prompt_tokens_details"] == {"cached_tokens": 32}
        assert usage({"cache_salt": "tenant-b"})["prompt_tokens_details"] == {"cached_tokens": 0}
        assert usage({"cache_salt": "tenant-b"})["prompt_tokens_details"] == {"cached_tokens": 32}
        for bad in (7, ""):
            refused = httpx.post(f"{base_url}/v1/completions", json={**body, "cache_salt": bad}, timeout=30)
            assert refused.status_code == 400 and "cache_salt" in refused.text
        metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
        assert 'vllm:prefix_cache_queries_total{model_name="tiny"} 160.0' in metrics
        assert 'vllm:prefix_cache_hits_total{model_name="tiny"} 64.0' in metrics
        assert "ferrox_batch_kv_blocks_cached" in metrics
