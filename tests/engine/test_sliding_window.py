"""A sliding-window model through the engine: its rows give back the pages behind the window (D8).

Ports the upstream's `a_window_model_slides_while_continuously_batched` (docs/upstream.md, Upstream tests):
a tiny random Mistral checkpoint with window 8, two requests of 400 tokens each on a store of 100 blocks of
4 positions. Each row is priced at 191 held positions (48 blocks) instead of 403 (101, more than the whole
store: the same model without a window cannot serve either, shown below), so both run at once; both finish
at full length with the ids each gets decoded alone, and every page comes back.

Also pinned: the ledger equals the store after every tick while rows slide, prefill long prompts in chunks
and reuse the pages they gave back; the greedy ids through the engine equal transformers'
`MistralForCausalLM` past many slides, on the C kernels and on torch's gather path; and a sliding row
neither adopts nor publishes cached prefix blocks, while a short row of the same model (which keeps every
page) still does.
"""

from __future__ import annotations


import pytest
import torch
from batch_helpers import budget_config, greedy_params, identity_decode, sequential_ids
from numerics import assert_decisive
from tiny_checkpoint import write_tiny_checkpoint
from worker_helpers import Caller, Gate, drain_reply, make_worker, wait_for, wait_sent, priced

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.engine.intake import size_request
from ferrox_batch.errors import KvBudgetExceeded
from ferrox_batch.generation_types import FinishReason
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels
from ferrox_batch.runtime.kv.paged_kv import PagedKvConfig
from ferrox_batch.runtime.kv.sliding import RELEASED
from ferrox_batch.runtime.loading.loader import load_model

WINDOW = 8
PROMPTS = ([1, 2, 3], [9, 8, 7])
#: Seed and scale of a checkpoint whose 400-token greedy continuations are decisive in float32 at every step.
CHECKPOINT = {"arch": "mistral", "tie": False, "std": 0.15, "seed": 9}


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("window-8"), sliding_window=WINDOW, **CHECKPOINT)


@pytest.fixture(scope="module")
def window_model(window_dir):
    model = load_model(window_dir, device="cpu", dtype="float32")
    assert model.config.uniform_window == WINDOW and model.config.max_position_embeddings >= 403
    return model


def paged(model, blocks: int, config: BatcherConfig, decode=identity_decode) -> ContinuousBatcher:
    store = model.decoder.new_store(4, num_blocks=blocks, prefix_cache=config.prefix_cache)
    return ContinuousBatcher.spawn_with_config_paged(model.decoder, decode, config, PagedKvConfig(store))


def test_a_window_model_slides_while_continuously_batched(window_model):
    gate = Gate()
    params = greedy_params(400)
    with paged(window_model, 100, budget_config(4, None), gate) as batcher:
        assert batcher.stats().kv_blocks_total == 100
        first = Caller(batcher, PROMPTS[0], params)
        gate.wait_calls(1)  # decoding, held
        second = Caller(batcher, PROMPTS[1], params)
        wait_sent(batcher, 1)
        gate.open()
        for caller, prompt in zip((first, second), PROMPTS):
            result = caller.join()
            assert result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == 400
            assert list(result.token_ids) == sequential_ids(window_model, prompt, params)
        assert batcher.stats().kv_blocks_peak == 96, "both rows at once, 48 blocks each"
        wait_for(lambda: batcher.stats().kv_blocks_free == 100, "every block back in the ledger")
        assert batcher.store.num_free_blocks == 100 and batcher.store.seq_ids() == []


def test_without_the_window_a_100_block_store_cannot_serve_either_row(window_dir, window_model):
    """The other side of the test above: priced at every position, one row alone needs 101 blocks."""
    plain = load_model(write_tiny_checkpoint(window_dir.parent / "no-window", sliding_window=None, **CHECKPOINT),
                       device="cpu", dtype="float32")
    assert plain.config.uniform_window is None
    with paged(plain, 100, budget_config(4, None)) as batcher:
        with pytest.raises(KvBudgetExceeded, match="needs 101 KV blocks") as refused:
            batcher.generate(PROMPTS[0], greedy_params(400))
        assert refused.value.binding == "device_memory_budget_exceeded"
    with paged(window_model, 100, budget_config(4, None)) as batcher:
        sized = size_request(list(PROMPTS[0]), greedy_params(400), batcher._budget, None, batcher._window)
        assert (sized.positions, sized.blocks, sized.window) == (191, 48, WindowPolicy(WINDOW, 4, 128))


def test_the_ledger_equals_the_store_at_every_tick_while_rows_slide_and_reuse_their_pages(window_model):
    config = BatcherConfig(prefill_chunk=16, kv_block_size=4, kv_blocks=100, slide_interval=16)
    worker = make_worker(window_model, config)
    budget, store = worker.scheduler.budget, worker.runner.store
    # A long prompt (prefilled in chunks that slide), and two long rows: all three slide.
    jobs = [priced(worker, list(range(3, 63)), 150), priced(worker, [7, 1, 4], 200), priced(worker, [5], 120)]
    assert all(request.window is not None for request, _ in jobs)
    for request, _ in jobs:
        worker.scheduler.add(request)
    pages_of: dict[int, set[int]] = {}  # block -> every page index it held
    most_at_once = most_released = 0
    while not worker.scheduler.idle:
        worker.tick()
        reserved = budget.total - budget.free()
        held = {block for seq_id in store.seq_ids() for block in store.seq(seq_id).blocks}
        assert reserved == len(held) == store.blocks_held(), "the ledger equals the store"
        assert budget.free() == store.num_free_blocks
        for seq_id in store.seq_ids():
            seq = store.seq(seq_id)
            assert seq.sliding is not None and len(seq.blocks) == budget.blocks_for(
                next(r.positions for r, _ in jobs if r.seq_id == seq_id))
            most_released = max(most_released, seq.sliding.released)
            for index, block in enumerate(seq.table.tolist()):
                if block != RELEASED:
                    pages_of.setdefault(block, set()).add(index)
        most_at_once = max(most_at_once, len(store.seq_ids()))
    assert most_at_once == 3 and most_released > 150
    assert any(len(pages) > 1 for pages in pages_of.values()), "a page given back held a later position"
    for (request, reply), prompt in zip(jobs, (list(range(3, 63)), [7, 1, 4], [5])):
        _, [result] = drain_reply(reply)
        assert list(result.token_ids) == sequential_ids(window_model, prompt, request.params)
    assert budget.free() == 100 and store.num_free_blocks == 100 and store.seq_ids() == []


@pytest.fixture(scope="module")
def transformers_ids(window_dir, window_model):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(window_dir, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    assert type(ref).__name__ == "MistralForCausalLM"
    prompt = [5, 17, 42]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=400, do_sample=False, eos_token_id=None,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert_decisive([step[0] for step in out.logits], window_model.config, len(prompt), note="transformers")
    return prompt, out.sequences[0, len(prompt):].tolist()


@pytest.mark.parametrize("interval,kernels", [(128, True), (8, True), (8, False)])
def test_greedy_ids_past_many_slides_equal_transformers(window_dir, transformers_ids, interval, kernels):
    prompt, want = transformers_ids
    model = load_model(window_dir, device="cpu", dtype="float32")
    if not kernels:
        model.decoder.kernels = None  # torch's gather path, as on CUDA
    elif cpu_kernels() is None:
        pytest.skip("no C kernels on this machine")
    # 48 blocks: one row of 403 positions fits only by sliding (it would need 101).
    config = BatcherConfig(prefill_chunk=2, kv_block_size=4, kv_blocks=48, slide_interval=interval)
    with paged(model, 48, config) as batcher:
        result = batcher.generate(prompt, greedy_params(400))
    assert list(result.token_ids) == want


def test_a_sliding_row_neither_adopts_nor_publishes_cached_blocks(window_model):
    prompt = list(range(20, 40))
    config = BatcherConfig(prefill_chunk=8, kv_block_size=4, kv_blocks=100, prefix_cache=True)
    with paged(window_model, 100, config) as batcher:
        store = batcher.store
        long = batcher.generate(prompt, greedy_params(300))  # slides: 20 + 300 positions in 45 blocks
        assert long.usage.cached_tokens == 0 and store.pool.num_cached == 0, "it published nothing"
        short = batcher.generate(prompt, greedy_params(5))  # keeps every page: publishes its prompt
        assert short.usage.cached_tokens == 0 and store.pool.num_cached >= 4
        again = batcher.generate(prompt, greedy_params(5))
        assert again.usage.cached_tokens == 16, "a row that keeps its pages adopts the prompt's 4 full blocks"
        slid = batcher.generate(prompt, greedy_params(300))
        assert slid.usage.cached_tokens == 0, "a sliding row adopts nothing, cached or not"
        assert list(slid.token_ids) == list(long.token_ids) == sequential_ids(window_model, prompt,
                                                                               greedy_params(300))
        assert list(again.token_ids) == list(short.token_ids) == list(long.token_ids[:5])
        wait_for(lambda: batcher.stats().kv_blocks_free == 100, "every block back")
