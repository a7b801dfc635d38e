"""The attention kernels' reference: exact (float64) attention of queries over paged keys and values,
and how far a float32 kernel may lie from it. Shared by the decode and prefill kernels' tests; a
prefill row is a decode query whose range ends at its own position."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from numerics import gamma, unit_roundoff


def random_case(rng: random.Random, n: int, kv: int, g: int, d: int, block: int, window: int | None, dtype):
    """A pool with randomly placed blocks, and what each sequence attends to."""
    lens = [rng.randint(1, 40) for _ in range(n)]
    blocks = [-(-length // block) for length in lens]
    order = list(range(1, sum(blocks) + 3))  # block 0 stays unused, as in the store
    rng.shuffle(order)
    tables = torch.zeros(n, max(blocks), dtype=torch.long)
    used = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = torch.tensor(order[used:used + count])
        used += count
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    pool = torch.randn((sum(blocks) + 3) * block, 2, kv, d, generator=gen).to(dtype)
    q = torch.randn(n, kv, g, d, generator=gen).to(dtype)
    hi = torch.tensor(lens)
    lo = torch.zeros(n, dtype=torch.long) if window is None else (hi - window).clamp(min=0)
    return q, pool, tables, lo, hi


def reference(q, pool, tables, lo, hi, block, scale=None):
    """Gather each sequence's keys and values and attend in float64 (exact next to float32)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        k, v = context(pool, tables, lo, hi, block, i)
        out[i] = F.scaled_dot_product_attention(q[i].double(), k, v, scale=scale)
    return out


def context(pool, tables, lo, hi, block, i):
    """Sequence i's keys and values, `[kv, L, d]` each, in float64."""
    pos = torch.arange(int(lo[i]), int(hi[i]))
    ctx = pool.double()[tables[i, pos // block] * block + pos % block]  # [L, 2, kv, d]
    return ctx[:, 0].transpose(0, 1), ctx[:, 1].transpose(0, 1)


#: The kernel's expf is glibc's vector expf (what -ffast-math lets GCC call), within 4 ulps; its scalar
#: expf, for a loop's tail, is within 1.
KERNEL_EXP_ULPS = 4


def decode_error_bound(q, pool, tables, lo, hi, block, scale):
    """Per output element, how far the kernel's float32 attention may be from the exact one (to first
    order; the products of two rounding errors are below u**2 and left out).

    The kernel computes s_t = (q . k_t) * scale, w_t = exp(s_t - max s), out = (sum_t w_t v_t) / sum_t w_t,
    summing in any order (vectorised, maybe with FMA). Errors, u = 2**-24:
    * a score: gamma_{d+1} * |scale| * sum_e |q_e k_te| (d products summed, then the scale);
    * a weight, relative: its score's error and the max's, u * (max - s_t) from the subtraction, and exp's
      KERNEL_EXP_ULPS (2u each). A relative error eps_t of w_t moves the output by
      p_t * eps_t * (v_t - out), p the exact softmax;
    * the two sums over the L positions: gamma_L * sum_t p_t |v_t| and gamma_L * |out|;
    * 1 / sum and the final product: 2u * |out|.
    """
    u = unit_roundoff(torch.float32)
    n, kv, g, d = q.shape
    bound = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        k, v = context(pool, tables, lo, hi, block, i)  # [kv, L, d]
        qi = q[i].double()  # [kv, g, d]
        s = torch.einsum("hgd,hld->hgl", qi, k) * scale
        score_error = gamma(d + 1) * abs(scale) * torch.einsum("hgd,hld->hgl", qi.abs(), k.abs())
        p = torch.softmax(s, -1)  # [kv, g, L]
        out = torch.einsum("hgl,hld->hgd", p, v)
        weight_error = (score_error + score_error.amax(-1, keepdim=True)
                        + u * (s.amax(-1, keepdim=True) - s) + 2 * KERNEL_EXP_ULPS * u)
        spread = (v[:, None, :, :] - out[:, :, None, :]).abs()  # [kv, g, L, d]
        moved = torch.einsum("hgl,hgld->hgd", p * weight_error, spread)
        summed = gamma(k.shape[1]) * (torch.einsum("hgl,hld->hgd", p, v.abs()) + out.abs())
        bound[i] = moved + summed + 2 * u * out.abs()
    return bound


def prefill_case(rng: random.Random, kv: int, g: int, d: int, dtype, *, chunks: int | None = None,
                 longest: int = 40, pool_dtype=None):
    """Prompt chunks over a shuffled pool: `(q, pool, chunk list)`. q `[rows, kv * g, d]` is a strided
    view of a wider projection (as the decoder's is); each chunk starts after 0-`longest` positions
    (half of them at 0) and has 1-`longest` rows, its slots drawn at random from the pool."""
    from ferrox_batch.runtime.kv.batch_inputs import PrefillChunk

    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    shapes = [(rng.choice([0, rng.randint(0, longest)]), rng.randint(1, longest))
              for _ in range(chunks or rng.randint(1, 3))]
    slots = sum(start + rows for start, rows in shapes) + 5
    pool = torch.randn(slots, 2, kv, d, generator=gen).to(pool_dtype or dtype)
    order = list(range(slots))
    rng.shuffle(order)
    taken = 0
    built = []
    for start, rows in shapes:
        built.append(PrefillChunk(torch.tensor(order[taken:taken + start + rows]), rows, None))
        taken += start + rows
    rows = sum(rows for _, rows in shapes)
    wide = torch.randn(rows, (kv * g + 2 * kv) * d, generator=gen).to(dtype)
    return wide[:, :kv * g * d].view(rows, kv * g, d), pool, built


def prefill_as_decode(q: torch.Tensor, pool: torch.Tensor, chunks, window: int | None):
    """The same attention as one decode query per prefill row: `(q [rows, kv, g, d], tables, lo, hi)` for
    `reference` and `decode_error_bound` with blocks of one slot. Row i of a chunk that starts at s
    attends to positions up to s + i, the last `window` of them with a window."""
    kv = pool.shape[2]
    rows, heads, d = q.shape
    width = max(chunk.ctx_slots.numel() for chunk in chunks)
    tables = torch.zeros(rows, width, dtype=torch.long)
    hi = torch.empty(rows, dtype=torch.long)
    row = 0
    for chunk in chunks:
        start = chunk.ctx_slots.numel() - chunk.length
        for i in range(chunk.length):
            tables[row, :chunk.ctx_slots.numel()] = chunk.ctx_slots
            hi[row] = start + i + 1
            row += 1
    lo = torch.zeros_like(hi) if window is None else (hi - window).clamp(min=0)
    return q.reshape(rows, kv, heads // kv, d), tables, lo, hi
