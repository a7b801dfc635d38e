"""The scheduler's side of the status lines (upstream status.rs, the two tests that need admission and the batch status; docs/upstream.md, Upstream tests).

Pins: the prefill line is what admission scheduled this tick (new
sequences and their real prompt tokens; nothing cached in the batcher), and
an idle admission pass logs no prefill line; the scheduler's `BatchStatus`
counts prefilling and decoding requests as running and waiting requests as
queued, reports KV pages from the block ledger (an empty pool without a
budget), and never claims a window or recurrent pool the model does not have.
(`tests/admission/test_status_lines.py` pins the line formats themselves.)
"""

from __future__ import annotations

import logging

from batch_helpers import budget_config, greedy_params
from worker_helpers import make_request, make_worker

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.status import PoolUsage, PrefillSnapshot


def _prefill_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch")]


def test_a_prefill_line_counts_the_tokens_the_batch_is_about_to_compute(tiny_batch_model, caplog):
    caplog.set_level(logging.INFO, logger="ferrox_batch.scheduler")
    worker = make_worker(tiny_batch_model, budget_config(4, 64))
    scheduler = worker.scheduler
    for prompt in ([1, 2, 3, 4], [5, 6]):
        scheduler.add(make_request(worker, prompt, greedy_params(2))[0])
    scheduler.schedule()
    [line] = _prefill_lines(caplog)
    assert line.startswith("Prefill batch, #new-seq: 2, #new-token: 6, #cached-token: 0, ")
    assert "#running-req: 2, #queue-req: 0" in line
    caplog.clear()
    scheduler.schedule()
    assert _prefill_lines(caplog) == [], "an idle admission pass schedules nothing"


def test_a_status_line_omits_the_pools_this_model_does_not_have(tiny_batch_model):
    worker = make_worker(tiny_batch_model, budget_config(4, 64))
    status = worker.scheduler.batch_status()
    assert status.kv_pages == PoolUsage(used=0, total=64) and status.page_size == 4
    assert (status.running_reqs, status.queue_reqs) == (0, 0)
    line = worker.scheduler.reporter.report_prefill(1.0, PrefillSnapshot(1, 3, 0), status)
    assert "#swa" not in line and "#mamba" not in line

    # Admitted work shows as used pages and running requests; a request behind the cap is queued.
    worker = make_worker(tiny_batch_model, budget_config(4, 64, max_seqs=1))
    worker.scheduler.waiting.extend(make_request(worker, [1, 2], greedy_params(6))[0] for _ in range(2))
    worker.scheduler.schedule()
    status = worker.scheduler.batch_status()
    assert status.kv_pages == PoolUsage(used=2, total=64)
    assert (status.running_reqs, status.queue_reqs) == (1, 1)

    worker = make_worker(tiny_batch_model, BatcherConfig(kv_block_size=4))  # a budget sized from memory
    budget = worker.scheduler.budget
    status = worker.scheduler.batch_status()
    assert status.kv_pages == PoolUsage(used=0, total=budget.total) and budget.total > 0
