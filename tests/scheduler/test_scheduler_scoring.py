"""A request that scores its prompt (`prompt_logprobs`), with no model: fake runner outputs only.

Pins: with `max_tokens=0` it is admitted (not answered at once), its prompt runs in chunks, it never samples,
and it finishes with `length` once its prompt is through; the prompt log-probabilities the runner reports
per chunk are gathered in order behind a `None` for the first token; it adopts no cached prefix (its
prompt must be computed to be scored).
"""

from __future__ import annotations

from scheduler_fakes import Bench

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.generation_types import GenerationResult
from ferrox_batch.logprobs import TokenLogprob


def test_a_scoring_request_runs_its_prompt_never_samples_and_gathers_what_the_runner_scored():
    bench = Bench(BatcherConfig(kv_block_size=4, prefill_chunk=4))
    prompt = list(range(1, 11))  # three chunks: 4, 4, 2
    request = bench.submit(prompt, 0, prompt_logprobs=0)
    peeked = []
    bench.kv.peek = lambda tokens, salt: (peeked.append(list(tokens)), (0, 0))[1]  # type: ignore[method-assign]
    while not bench.scheduler.idle:
        plan = bench.scheduler.schedule()
        if plan.empty:
            continue
        assert not plan.sampling, "a scoring request with max_tokens=0 never samples"
        bench.kv.run(plan)
        (chunk,) = plan.prompts
        start = chunk.request.num_computed_tokens
        # What the runner reports: the prompt tokens this chunk's rows predict (never the first token).
        scored = [TokenLogprob(t, -float(t)) for t in prompt[start + 1:start + 1 + len(chunk.tokens)]]
        bench.scheduler.update(plan, [], None, {0: scored})
    result = bench.sink(request).result
    assert isinstance(result, GenerationResult) and result.finish_reason.kind == "length" and not result.token_ids
    assert result.prompt_logprobs[0] is None
    assert [e.token for e in result.prompt_logprobs[1:]] == prompt[1:]
    assert peeked == [] or all(tokens == [] for tokens in peeked)  # it asked the cache for nothing
    bench.assert_nothing_held()
