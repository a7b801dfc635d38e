"""Several choices for one request: `n`, and `best_of` (completions), as rows of the one batcher.

A request with `n` choices (or `best_of` candidates) becomes that many batcher requests with the same
prompt. They promise:

* **One prompt prefill.** The first candidate is submitted as usual; the others follow its prompt
  (`ContinuousBatcher.submit(after=...)`): each is admitted once the first one's prompt is through, so
  with the prefix cache it adopts the prompt's blocks and computes only its last partial block.
* **Seeded per choice.** With a `seed`, candidate i draws from `seed + i`, so a seeded request is
  reproducible and its choices still differ; without one each draws its own entropy.
* **`best_of`** ranks the candidates by the sum of their tokens' log-probabilities (the model's own, the
  same numbers `logprobs` reports) and returns the best `n`, best first; a request that asked for no
  log-probabilities gets none although the ranking computed them.
* **Streams** interleave the choices' chunks as they come, each naming its `index`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from ferrox_batch.checks import UNLIMITED
from ferrox_batch.generation_types import GenerationParams, GenerationResult
from ferrox_batch.replies import Finished
from ferrox_batch.server.http.streaming import Event, ReplyBridge

#: The most choices (`n`) or candidates (`best_of`) one request may ask for per prompt: each is a row of the batch.
MAX_CHOICES = 16
#: The most rows one completion request may take over all its prompts (prompts x `best_of`): an
#: evaluation harness batching its prompts sends tens.
MAX_PROMPT_ROWS = 64


def candidate_params(params: GenerationParams, count: int, rank: bool) -> list[GenerationParams]:
    """The params of each of `count` candidates (`rank`: `best_of` needs their log-probabilities)."""
    if rank and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)
    if count == 1 or params.seed is None:
        return [params] * count
    return [dataclasses.replace(params, seed=(params.seed + i) % (UNLIMITED + 1)) for i in range(count)]


def best(results: Sequence[GenerationResult], n: int, keep_logprobs: bool) -> list[GenerationResult]:
    """The `n` results with the highest cumulative log-probability (ties keep submission order)."""
    if len(results) > n:
        order = sorted(range(len(results)), key=lambda i: -sum(e.logprob for e in results[i].logprobs or ()))
        results = [results[i] for i in order[:n]]
    if not keep_logprobs:
        results = [dataclasses.replace(r, logprobs=None) for r in results]
    return list(results)


async def merged(bridges: Sequence[ReplyBridge]) -> AsyncIterator[tuple[int, Event]]:
    """Every bridge's events, tagged with its index, in the order they arrive; ends after every final."""
    if len(bridges) == 1:  # the common case: no task per event
        while True:
            event = await bridges[0].next_event()
            yield 0, event
            if isinstance(event, Finished):
                return
    waiting = {asyncio.ensure_future(b.next_event()): i for i, b in enumerate(bridges)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: waiting[t]):
                index = waiting.pop(task)
                event = task.result()
                yield index, event
                if not isinstance(event, Finished):
                    waiting[asyncio.ensure_future(bridges[index].next_event())] = index
    finally:
        for task in waiting:
            task.cancel()  # asyncio.Queue keeps an item a cancelled getter did not take
