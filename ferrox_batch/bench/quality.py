"""What a reduced precision costs in quality on a model: perplexity on a fixed text, greedy agreement with fp32.

The precisions `--dtype auto` may pick (`runtime.device`) must hold `QUALITY_BOUND` against fp32 on the
default model; a test measures it with `perplexity` on the text shipped in `tests/data/`, and
`scripts/bench_quality.py` adds the greedy agreement over the benchmark's shape (a) prompts.

Perplexity is computed from one prefill of the whole text through `Decoder.forward_every` (each position's
logits, read in float64); agreement is measured on what the served batcher generates, greedy with EOS
ignored, as the fraction of generated tokens before each request's first divergence from fp32 and the
fraction of requests identical throughout.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferrox_batch.runtime.architectures.decoder import Decoder
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.loader import LoadedModel

#: Positions per KV block of the throwaway store a perplexity pass uses.
_BLOCK = 16


@dataclass(frozen=True, slots=True)
class Agreement:
    """How greedy outputs of one precision match fp32's, request by request."""

    #: Generated tokens before each request's first divergence, summed, over all generated tokens.
    prefix_fraction: float
    #: Requests whose whole output equals fp32's, over all requests.
    identical_fraction: float


def perplexity(decoder: Decoder, ids: Sequence[int]) -> float:
    """exp of the mean negative log-likelihood of `ids[1:]`, each given the ids before it."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    store = decoder.new_store(_BLOCK, num_blocks=math.ceil(len(ids) / _BLOCK))
    store.add_sequence(0, len(ids))
    _, (every,) = decoder.forward_every([SeqChunk(0, list(ids))], store, [0])
    logprobs = torch.log_softmax(every[:-1].double(), dim=-1)
    targets = torch.tensor(list(ids[1:]), device=logprobs.device)[:, None]
    return math.exp(-logprobs.gather(1, targets).mean().item())


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> Agreement:
    """`other`'s outputs against `reference`'s, request by request (the same prompts, in order)."""
    if len(reference) != len(other) or not reference:
        raise ValueError("agreement needs the same, non-zero number of outputs on both sides")
    matched = total = identical = 0
    for want, got in zip(reference, other):
        same = 0
        for a, b in zip(want, got):
            if a != b:
                break
            same += 1
        matched += same
        total += len(want)
        identical += list(want) == list(got)
    return Agreement(matched / total if total else 1.0, identical / len(reference))


def greedy_outputs(model: LoadedModel, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt's greedy continuation from the served batcher, all submitted at once."""
    from ferrox_batch.admission.config import BatcherConfig
    from ferrox_batch.engine.handle import ContinuousBatcher
    from ferrox_batch.generation_types import GenerationParams

    blocks = sum(math.ceil((len(p) + max_tokens) / _BLOCK) for p in prompts)
    batcher = ContinuousBatcher.from_model(model, BatcherConfig(kv_blocks=blocks, kv_block_size=_BLOCK))
    outputs: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            result = batcher.generate(list(prompts[i]), GenerationParams(max_tokens=max_tokens, ignore_eos=True))
            outputs[i] = list(result.token_ids)
        except BaseException as error:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        batcher.close()
    if errors:
        raise errors[0]
    return outputs
