"""Log-probabilities, the model's own: `log_softmax` of the raw logits, with the most likely alternatives.

One module for both places they are read: each sampled token's (`token_logprobs`, for the rows that asked,
after the sampler chose their tokens) and each scored prompt token's (`prompt_logprobs`, from the rows of
the prompt's own forward). Both are before penalties, `logit_bias`, temperature and every filter, as vLLM
and llama.cpp report them, and both cost nothing for requests that did not ask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferrox_batch.logprobs import TokenLogprob
from ferrox_batch.prompt_logprobs import PromptLogprobs
from ferrox_batch.runtime.sampling.sampler_rows import RowSampler


def ranked_tensors(logits: torch.Tensor, chosen: torch.Tensor,
                   top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row of `logits` (`[n, vocab]`), on its device: the log-probability of its `chosen` id
    (`[n]`, float32), the ids (`[n, top]`, int64) and log-probabilities (`[n, top]`) of its `top` most
    likely tokens (`[n, 0]` when `top` is 0), and the chosen id's rank (`[n]`, int64: 1 + the tokens
    strictly likelier). The one computation both sampled and prompt tokens' log-probabilities read."""
    lp = logits.float().log_softmax(dim=-1)
    picked = lp.gather(1, chosen.unsqueeze(1))
    rank = (lp > picked).sum(dim=-1) + 1
    if top:
        values, ids = lp.topk(top, dim=-1)
    else:
        values, ids = lp.new_empty(len(lp), 0), lp.new_empty(len(lp), 0, dtype=torch.long)
    return picked.squeeze(1), ids, values, rank


def ranked(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> tuple[list[float], list[list[int]],
                                                                          list[list[float]], list[int]]:
    """`ranked_tensors` as host lists: (chosen log-probabilities, top ids, top log-probabilities, ranks)."""
    picked, ids, values, rank = ranked_tensors(logits, chosen, top)
    return picked.tolist(), ids.tolist(), values.tolist(), rank.tolist()


def token_logprobs(x: torch.Tensor, tokens: torch.Tensor, host: list[int], rows: Sequence[RowSampler],
                   scored: list[int]) -> dict[int, TokenLogprob]:
    """The log-probabilities (of the raw logits `x`) of each scored row's sampled token (`tokens`, on the
    device; `host`, the same ids on the host), with as many alternatives as each row asked for."""
    index = torch.tensor(scored, device=x.device)
    k = max(rows[i].logprobs or 0 for i in scored)
    chosen, top_i, top_v, rank = ranked(x.index_select(0, index), tokens.index_select(0, index), k)
    out = {}
    for n, i in enumerate(scored):
        want = rows[i].logprobs or 0
        out[i] = TokenLogprob(host[i], chosen[n], tuple(zip(top_i[n][:want], top_v[n][:want])), rank[n])
    return out


def prompt_logprobs(rows: torch.Tensor, targets: Sequence[int], top: int, vocab_size: int) -> PromptLogprobs:
    """The log-probabilities of the prompt tokens a chunk's rows predict: row j predicts `targets[j]` (the
    chunk's last row predicts the next chunk's first token); `rows` may hold more rows than targets. They
    go from the device to flat host arrays in one copy each, never through per-entry Python objects."""
    if not targets:
        return PromptLogprobs(top)
    picked, ids, values, rank = ranked_tensors(rows[:len(targets), :vocab_size],
                                               torch.tensor(list(targets), device=rows.device), top)
    host = [t.contiguous().cpu().numpy().tobytes() for t in (picked, rank.to(torch.int32), ids.to(torch.int32), values)]
    return PromptLogprobs.from_buffers(top, targets, *host)
