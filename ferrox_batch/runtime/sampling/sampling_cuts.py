"""Where top_k and top_p cut each row: the value below which a token is dropped.

Split out of `sampler` (which applies the cuts): this is the part that must be
fast on the CPU and exact everywhere. Cuts are by value, so tied logits are
kept or dropped together. On the CPU the cut is found without `torch.sort`:
top_k+top_p rows look inside their top-k (past the k-th value every
probability is exactly 0), other top_p rows sort values with numpy (values
only, bit-identical to torch's) and widen a running-sum prefix until a bound
proves no later token can be kept. On other devices one `torch.sort` keeps
the single host sync of the sampler.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

#: On the CPU, rows with top_k and top_p look for top_p's cut in their top-k
#: before sorting whole; False sends them straight to the full sort (the tests
#: compare the two).
_TOP_K_HEAD = True
#: On the CPU, top_p's running sum first covers this many of the sorted probabilities (see _sorted_nucleus).
_PREFIX = 1024


def _index(rows: Sequence[int], total: int, device: torch.device) -> torch.Tensor | None:
    """An index tensor for `rows`, or None when they are all `total` rows in order."""
    return None if len(rows) == total else torch.tensor(rows, dtype=torch.long, device=device)


def _pick(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return t if index is None else t.index_select(0, index)


def _put(into: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    return rows if index is None else into.index_copy_(0, index, rows)


def cuts(
    l: torch.Tensor, ks: Sequence[int], top_k: torch.Tensor, top_p: torch.Tensor,
    k_rows: Sequence[int], p_rows: Sequence[int],
) -> torch.Tensor:
    """Each row's `[B, 1]` cut: tokens below it are dropped (-inf: no cut).

    top_k's cut is the k-th largest logit. top_p's is the logit of the last
    token of the shortest prefix of the sorted row whose preceding mass stays
    < top_p, the masses being the softmax of the sorted, top_k-cut row. Off
    the CPU one sort serves every row with a cut and nothing is read back. On
    the CPU a row with top_k and top_p looks in its top-k first
    (`_nucleus_from_top_k`), and a top_p row without top_k sorts its values
    with numpy (`_sorted_values`).
    """
    b, n = l.shape
    dev = l.device
    cut = torch.full_like(top_p, float("-inf"))
    if p_rows and not _reads_back(dev):
        index = _index(sorted({*k_rows, *p_rows}), b, dev)
        ordered = _sorted_values(_pick(l, index))
        kc, pc = _pick(top_k, index), _pick(top_p, index)
        kth = torch.where(kc > 0, ordered.gather(1, (kc.long() - 1).clamp_(min=0)), float("-inf"))
        return _put(cut, index, torch.maximum(kth, _sorted_nucleus(ordered, kth, pc)))
    with_p = sorted(set(k_rows) & set(p_rows))
    if k_rows:
        index = _index(k_rows, b, dev)
        # Enough for every row's k-th value; a top_p row's also wants to see where its ties end,
        # and at least 16 logits (see _nucleus_from_top_k).
        width = min(n, max(max(ks) + 1, 16)) if with_p else max(ks)
        head = torch.topk(_pick(l, index), width, dim=-1).values
        cut = _put(cut, index, head.gather(1, (_pick(top_k, index).long() - 1).clamp_(min=0)))
        if with_p:
            place = {row: i for i, row in enumerate(k_rows)}
            index = _index(with_p, b, dev)
            head = _pick(head, _index([place[i] for i in with_p], len(k_rows), dev))
            cut = _put(cut, index, _nucleus_from_top_k(l, index, head, _pick(cut, index), _pick(top_p, index)))
    without_k = [i for i in p_rows if not ks[i]]
    if without_k:
        index = _index(without_k, b, dev)
        cut = _put(cut, index, _sorted_nucleus(_sorted_values(_pick(l, index)), None, _pick(top_p, index)))
    return cut


def _reads_back(device: torch.device) -> bool:
    """Whether the cuts may read tensors back to choose a path: free on the CPU, a sync anywhere else."""
    return device.type == "cpu"


def _sorted_values(l: torch.Tensor) -> torch.Tensor:
    """Each row's logits, largest first.

    Values only, which every sort gives alike (tie order cannot show), so on
    the CPU numpy sorts them: about ten times faster than `torch.sort`, which
    also sorts indices. Negating around an ascending sort flips each sign bit
    twice, giving back every value bit for bit.
    """
    if l.device.type != "cpu":
        return torch.sort(l, dim=-1, descending=True).values
    flipped = np.negative(l.detach().numpy())
    flipped.sort(axis=-1)
    return torch.from_numpy(np.negative(flipped, out=flipped))


def _sorted_nucleus(ordered: torch.Tensor, kth: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """top_p's cut, from sorted logits (all of a row's, or a prefix holding every one above its top_k cut).

    -inf for rows with top_p = 1 (and for none of the others). `kth` is the
    rows' top_k cut, None when no row has one. The running sum is sequential,
    so its first values do not depend on how far it runs: on the CPU it runs
    over a prefix of the sorted probabilities, widened until every row's
    prefix is sure to hold the cut (`_holds`).
    """
    masked = ordered if kth is None else ordered.masked_fill(ordered < kth, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    n = probs.shape[1]
    width = min(n, _PREFIX) if _reads_back(probs.device) else n
    while True:
        head = probs[:, :width]
        running = head.cumsum(dim=-1)
        if width == n or all(_holds(running[:, -1:], top_p).squeeze(1).tolist()):
            break
        width = min(n, width * 8)
    before = running - head  # mass strictly ahead of each sorted token
    keep = (before < top_p).sum(dim=-1, keepdim=True)  # >= 1: before[0] is exactly 0
    last = ordered.gather(1, (keep - 1).clamp_(min=0))  # the clamp is for a NaN row only
    return torch.where(top_p < 1.0, last, float("-inf"))


def _holds(mass: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Whether a sorted prefix whose running sum ends at `mass` holds top_p's cut: no later token is kept.

    A later token's preceding mass is at least `mass` less two float32
    roundings of the running sum (under 2**-24 each, below 2), so from
    top_p + 2**-22 on it is >= top_p.
    """
    return (mass.double() >= top_p.double() + 2.0**-22) | (top_p >= 1.0)


def _nucleus_from_top_k(
    l: torch.Tensor, index: torch.Tensor | None, head: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The cut of rows `index` of `l`, which have top_k and top_p, from `head`, their largest logits sorted.

    Past the top_k cut a sorted row's tokens weigh exactly 0, and the CPU
    softmax only ever adds those zeros into its vector lanes, so over a head
    of >= 16 logits that holds every token >= the k-th it sums the same bits
    as over the whole sorted row (the tests check this): the same masses, the
    same running sum. Tokens past the head cannot move the cut either: where
    the full sort would keep one, its preceding mass is the whole mass, so it
    would keep every zero-weight token in the head too and the top_k cut
    rules. Only a row whose ties with the k-th logit may run on past the
    head (its last logit still >= the k-th) has to sort whole.
    """
    n = l.shape[1]
    cut = torch.maximum(kth, _sorted_nucleus(head, kth, top_p))
    if head.shape[1] == n or not _TOP_K_HEAD:
        spill = list(range(head.shape[0])) if head.shape[1] < n else []
    else:
        spill = [i for i, tied in enumerate((head[:, -1:] >= kth).squeeze(1).tolist()) if tied]
    if spill:
        at = _index(spill, head.shape[0], l.device)
        ordered = _sorted_values(_pick(l, at if index is None else _pick(index, at)))
        kth_spill = _pick(kth, at)
        cut = _put(cut, at, torch.maximum(kth_spill, _sorted_nucleus(ordered, kth_spill, _pick(top_p, at))))
    return cut
