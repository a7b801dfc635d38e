"""A hybrid-window model through the engine: its local layers' KV groups slide, its global one keeps all.

The tiny Gemma 3 checkpoint has two local layers (window 6) and a global one, so its store has three KV
groups of one layer each (`admission.kv_groups`). A row of 3 + 200 positions in blocks of 2 holds 102
blocks in the global group and 29 (its hold bound) in each local one: 160 blocks, where keeping every
position in every layer takes 306. Pinned here: several such rows at once give the ids each gets alone and
transformers' greedy `Gemma3ForCausalLM` ids, on the C kernels and on torch's gather path; the ledger equals
the store at every tick while the local groups slide and reuse their pages; every block comes back; a row
that fits only because its local groups slide is refused by the old arithmetic and served by the new; the
status line and the stats report what each kind of group holds.
"""

from __future__ import annotations


import pytest
import torch
from batch_helpers import greedy_params, identity_decode, sequential_ids
from numerics import assert_decisive
from worker_helpers import drain_reply, make_worker, wait_for, priced

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.engine.intake import size_request
from ferrox_batch.errors import KvBudgetExceeded
from ferrox_batch.generation_types import FinishReason
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels
from ferrox_batch.runtime.kv.paged_kv import PagedKvConfig
from ferrox_batch.runtime.kv.sliding import RELEASED
from ferrox_batch.runtime.loading.loader import load_model

PROMPTS = ([5, 17, 42], [9, 8, 7], [1, 30, 2])
STEPS = 200
BLOCK = 2
#: Per row: 102 global blocks + 2 x 29 local ones (the hold bound at slide interval 4), against 3 x 102.
ROW_BLOCKS, OLD_ROW_BLOCKS = 160, 306


def config(blocks: int, **kw) -> BatcherConfig:
    return BatcherConfig(prefill_chunk=kw.pop("prefill_chunk", 2), kv_block_size=BLOCK, kv_blocks=blocks,
                         slide_interval=4, **kw)


@pytest.fixture(scope="module")
def gemma(tiny_variant_dirs):
    model = load_model(tiny_variant_dirs["gemma3"], device="cpu", dtype="float32")
    c = model.config
    assert c.sliding_window == 6 and c.uniform_window is None and c.max_position_embeddings >= 3 + STEPS
    return model


def paged(model, blocks: int, cfg: BatcherConfig) -> ContinuousBatcher:
    store = model.decoder.new_store(BLOCK, num_blocks=blocks, prefix_cache=cfg.prefix_cache)
    return ContinuousBatcher.spawn_with_config_paged(model.decoder, identity_decode, cfg, PagedKvConfig(store))


def test_the_store_is_three_groups_and_a_row_is_priced_over_them(gemma):
    with paged(gemma, 200, config(200)) as batcher:
        groups = batcher.store.groups
        assert groups.layers == ((2,), (0,), (1,)) and groups.local == (False, True, True)
        assert batcher.store.kv.shape[0] == 1, "a block holds one layer's K/V"
        sized = size_request(list(PROMPTS[0]), greedy_params(STEPS), batcher._budget, None, batcher._window,
                             groups=batcher._pricing)
        assert (sized.positions, sized.blocks) == (57, ROW_BLOCKS) and sized.window is not None


def test_a_row_that_fits_only_because_its_local_groups_slide(gemma):
    with paged(gemma, 200, config(200)) as batcher:
        # Priced as before hybrid groups, every layer holding every position: more than the whole store.
        with pytest.raises(KvBudgetExceeded, match=f"needs {OLD_ROW_BLOCKS} KV blocks"):
            size_request(list(PROMPTS[0]), greedy_params(STEPS), batcher._budget, None, None,
                         groups=batcher.store.groups.pricing(None))
        result = batcher.generate(PROMPTS[0], greedy_params(STEPS))
        assert result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == STEPS
        assert list(result.token_ids) == sequential_ids(gemma, PROMPTS[0], greedy_params(STEPS))
        assert batcher.stats().kv_blocks_peak == ROW_BLOCKS
        wait_for(lambda: batcher.stats().kv_blocks_free == 200, "every block back in the ledger")
        assert batcher.store.num_free_blocks == 200 and batcher.store.blocks_by_kind() == (0, 0)


def test_concurrent_rows_equal_each_alone_and_the_ledger_equals_the_store_at_every_tick(gemma):
    # The 37-token prompt holds 119 + 2 x 46 blocks: all three rows fit at once in 531.
    worker = make_worker(gemma, config(531, prefill_chunk=16))
    budget, store = worker.scheduler.budget, worker.runner.store
    prompts = [list(PROMPTS[0]), list(range(3, 40)), list(PROMPTS[2])]
    jobs = [priced(worker, prompt, STEPS) for prompt in prompts]
    assert all(request.window is not None for request, _ in jobs)
    for request, _ in jobs:
        worker.scheduler.add(request)
    reused = most_at_once = 0
    seen_kinds: set[tuple[int, int]] = set()
    while not worker.scheduler.idle:
        worker.tick()
        reserved = budget.total - budget.free()
        held = {block for seq_id in store.seq_ids() for block in store.seq(seq_id).blocks}
        assert reserved == len(held) == store.blocks_held() == sum(store.blocks_by_kind()), "ledger == store"
        for seq_id in store.seq_ids():
            seq = store.seq(seq_id)
            request = next(r for r, _ in jobs if r.seq_id == seq_id)
            assert len(seq.blocks) == request.blocks
            global_table, *local = seq.groups
            assert global_table.sliding is None and RELEASED not in global_table.table.tolist()
            assert len({tuple(g.table.tolist()).count(RELEASED) for g in local}) == 1, "locals slide in lockstep"
            reused = max(reused, local[0].sliding.released)
        seen_kinds.add(store.blocks_by_kind())
        most_at_once = max(most_at_once, len(store.seq_ids()))
    assert most_at_once == 3 and reused > 100
    assert any(g and l for g, l in seen_kinds), "both kinds of group held blocks"
    for (request, reply), prompt in zip(jobs, prompts):
        _, [result] = drain_reply(reply)
        assert list(result.token_ids) == sequential_ids(gemma, prompt, request.params)
    assert budget.free() == budget.total and store.num_free_blocks == budget.total and store.seq_ids() == []


def test_the_status_line_and_the_stats_report_each_kind_of_group(gemma, caplog):
    caplog.set_level("INFO", logger="ferrox_batch.scheduler")
    with paged(gemma, 200, config(200)) as batcher:
        batcher.generate(PROMPTS[0], greedy_params(60))
        wait_for(lambda: batcher.stats().kv_blocks_free == 200, "every block back")
        stats = batcher.stats()
        assert (stats.kv_blocks_global, stats.kv_blocks_local) == (0, 0)
    lines = [r.getMessage() for r in caplog.records if "Decode batch" in r.getMessage()]
    assert lines and all("full token usage: " in line and "swa token usage: " in line for line in lines)
    prefill = next(r.getMessage() for r in caplog.records if "Prefill batch" in r.getMessage())
    # Priced at admission: 32 blocks in the global group (63 positions), 2 x 29 in the local ones.
    assert "full token usage: 0.16, swa token usage: 0.29" in prefill


@pytest.fixture(scope="module")
def transformers_ids(tiny_variant_dirs, gemma):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_variant_dirs["gemma3"], dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    assert type(ref).__name__ == "Gemma3ForCausalLM"
    out = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            assert_decisive([step[0] for step in gen.logits], gemma.config, len(prompt), note="transformers")
            out[tuple(prompt)] = gen.sequences[0, len(prompt):].tolist()
    return out


@pytest.mark.parametrize("kernels", [True, False])
def test_concurrent_rows_past_many_slides_equal_transformers(tiny_variant_dirs, transformers_ids, kernels):
    model = load_model(tiny_variant_dirs["gemma3"], device="cpu", dtype="float32")
    if not kernels:
        model.decoder.kernels = None  # torch's gather path, as on CUDA
    elif cpu_kernels() is None:
        pytest.skip("no C kernels on this machine")
    blocks = 3 * ROW_BLOCKS
    with paged(model, blocks, config(blocks, max_prefills_per_tick=3)) as batcher:
        tickets = [batcher.submit(prompt, greedy_params(STEPS)) for prompt in PROMPTS]
        results = [ticket.wait() for ticket in tickets]
        for prompt, result in zip(PROMPTS, results):
            assert list(result.token_ids) == transformers_ids[tuple(prompt)]
        assert batcher.stats().kv_blocks_peak == blocks, "all three rows at once"
        wait_for(lambda: batcher.stats().kv_blocks_free == blocks, "every block back")
        assert batcher.store.num_free_blocks == blocks and batcher.store.seq_ids() == []
