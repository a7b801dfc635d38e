"""Turning a varlen batch (prefill chunks and single-token decodes) into the tensors one forward needs.

A forward sees one flat row of tokens. Sequences are laid out decodes first
(one token each) and then prefill chunks, so the attention of each group is a
plain slice of the flat projections:

* decode group: `B` queries, one per sequence; each attends to its own
  gathered context `[B, L]` (L = the longest context in the group) under a
  length mask, or, for the paged decode kernel (`decode_gather=False`),
  straight from the pool through its block table and key range;
* prefill group: `P` chunks padded to the longest chunk `Q`; each query
  attends causally to its sequence's context.

Everything is built once per forward and shared by every layer; positions
come from the store (the KV is the only cursor), and the new tokens' slots are
computed from the block tables, so no per-layer or per-sequence Python work
happens inside the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ferrox_batch.errors import TokenOutOfVocab
from ferrox_batch.models.paged_kv import PagedKvStore


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """`tokens` to append to sequence `seq_id`, starting at its current KV length."""

    seq_id: Hashable
    tokens: Sequence[int]


@dataclass(slots=True)
class AttnGroup:
    """Context slots (flattened `[N * L]`) and a boolean mask broadcastable to the group's scores.

    The decode group also carries what the paged kernel reads instead: the padded block
    tables and each sequence's key range `lo .. hi - 1`; without a gather its `ctx_slots`
    and `mask` are None.
    """

    ctx_slots: torch.Tensor | None
    mask: torch.Tensor | None
    count: int
    q_len: int  # 1 for the decode group, the padded chunk length for the prefill group
    pad_index: torch.Tensor | None = None  # flat rows -> padded [N*q_len] (prefill, N > 1)
    unpad_index: torch.Tensor | None = None  # padded rows -> flat rows (prefill, N > 1)
    tables: torch.Tensor | None = None  # [N, max_blocks] int64 (decode group)
    lo: torch.Tensor | None = None  # [N] first key attended (decode group)
    hi: torch.Tensor | None = None  # [N] one past the last key (decode group)


@dataclass(slots=True)
class BatchInputs:
    tokens: torch.Tensor  # [T] in flat (decodes-first) order
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] where each token's K/V is written
    decode: AttnGroup | None
    prefill: AttnGroup | None
    last_rows: torch.Tensor  # [S] flat row of each sequence's last token, in the caller's order
    new_lengths: list[tuple[Hashable, int]]


def build_inputs(
    chunks: Sequence[SeqChunk],
    store: PagedKvStore,
    vocab_size: int,
    sliding_window: int | None,
    group_size: int,
    decode_gather: bool = True,
) -> BatchInputs:
    """`group_size` is query heads per KV head: prefill queries are laid out `(query, group)`.

    `decode_gather=False` skips the decode group's context slots and mask (the paged kernel
    reads the tables instead).
    """
    if not chunks:
        raise ValueError("a forward needs at least one sequence; got an empty batch")
    seen: set[Hashable] = set()
    for chunk in chunks:
        if chunk.seq_id in seen:
            raise ValueError(f"sequence {chunk.seq_id!r} appears twice in one batch")
        seen.add(chunk.seq_id)
        if len(chunk.tokens) == 0:
            raise ValueError(f"sequence {chunk.seq_id!r} has an empty chunk")
    device = store.device
    bs = store.block_size
    # Decodes first, then prefill chunks; `order[j]` is the caller's index of flat sequence j.
    order = [i for i, c in enumerate(chunks) if len(c.tokens) == 1]
    order += [i for i, c in enumerate(chunks) if len(c.tokens) > 1]
    n_decode = sum(1 for c in chunks if len(c.tokens) == 1)

    flat_tokens: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    tables: list[torch.Tensor] = []
    new_lengths: list[tuple[Hashable, int]] = []
    for i in order:
        chunk = chunks[i]
        seq = store.seq(chunk.seq_id)
        end = seq.length + len(chunk.tokens)
        if end > seq.capacity:
            raise ValueError(
                f"sequence {chunk.seq_id!r} would reach {end} positions but its KV lease "
                f"holds {seq.capacity}"
            )
        flat_tokens.extend(chunk.tokens)
        starts.append(seq.length)
        lens.append(len(chunk.tokens))
        tables.append(seq.table)
        new_lengths.append((chunk.seq_id, end))

    tokens = torch.tensor(flat_tokens, dtype=torch.long)
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bool(bad.any()):
        raise TokenOutOfVocab(int(tokens[bad.nonzero()[0, 0]]), vocab_size)
    tokens = tokens.to(device)

    decode = prefill = None
    pos_parts: list[torch.Tensor] = []
    slot_parts: list[torch.Tensor] = []
    if n_decode:
        d_tables = _pad_tables(tables[:n_decode], device)
        d_pos = torch.tensor(starts[:n_decode], dtype=torch.long, device=device)
        pos_parts.append(d_pos)
        slot_parts.append(_slots(d_tables, d_pos[:, None], bs).squeeze(1))
        ctx_len = d_pos + 1
        lo = torch.zeros_like(d_pos) if sliding_window is None else (ctx_len - sliding_window).clamp(min=0)
        decode = AttnGroup(None, None, n_decode, 1, tables=d_tables, lo=lo, hi=ctx_len)
        if decode_gather:
            width = int(max(starts[:n_decode])) + 1
            keys = torch.arange(width, device=device)
            ctx = _slots(d_tables, keys[None, :].expand(n_decode, width), bs)
            mask = (keys[None, :] < ctx_len[:, None]) & (keys[None, :] >= lo[:, None])
            all_full = bool(mask.all())
            decode.ctx_slots = ctx.reshape(-1)
            decode.mask = None if all_full else mask[:, None, None, :]
    if n_decode < len(order):
        p_starts = starts[n_decode:]
        p_lens = lens[n_decode:]
        count = len(p_lens)
        q_len = max(p_lens)
        p_tables = _pad_tables(tables[n_decode:], device)
        start_t = torch.tensor(p_starts, dtype=torch.long, device=device)
        len_t = torch.tensor(p_lens, dtype=torch.long, device=device)
        q_idx = torch.arange(q_len, device=device)
        qpos = start_t[:, None] + q_idx[None, :]  # [P, Q]
        valid_q = q_idx[None, :] < len_t[:, None]
        flat_pos = qpos[valid_q]
        pos_parts.append(flat_pos)
        # Padding queries (past a chunk's end) may lie past that sequence's block table: point
        # them at the chunk's first position before the lookup; their slots are dropped anyway.
        slot_parts.append(_slots(p_tables, torch.where(valid_q, qpos, start_t[:, None]), bs)[valid_q])
        width = int(max(s + n for s, n in zip(p_starts, p_lens)))
        keys = torch.arange(width, device=device)
        ctx = _slots(p_tables, keys[None, :].expand(count, width), bs)
        mask = keys[None, None, :] <= qpos[:, :, None]  # [P, Q, L] causal
        if sliding_window is not None:
            mask &= keys[None, None, :] > (qpos[:, :, None] - sliding_window)
        # Padding queries attend to key 0 only, so their softmax is finite; their output is dropped.
        mask = torch.where(valid_q[:, :, None], mask, keys[None, None, :] == 0)
        pad_index = unpad_index = None
        if count > 1:
            padded_rows = torch.arange(count * q_len, device=device).view(count, q_len)
            unpad_index = padded_rows[valid_q]
            # Each padded row reads some flat row (pads read row 0 of the group).
            pad_index = torch.zeros(count * q_len, dtype=torch.long, device=device)
            pad_index[unpad_index] = torch.arange(unpad_index.numel(), device=device)
        # Scores are `[P, kv_heads, Q * group, L]` (GQA without expanding K/V), so each
        # query's mask row repeats for the query heads that share a KV head.
        mask = mask[:, None, :, None, :].expand(count, 1, q_len, group_size, width)
        prefill = AttnGroup(
            ctx.reshape(-1), mask.reshape(count, 1, q_len * group_size, width), count, q_len, pad_index, unpad_index
        )

    positions = torch.cat(pos_parts)
    slots = torch.cat(slot_parts)
    # Last flat row of each sequence, returned in the caller's order.
    ends = torch.tensor(lens, dtype=torch.long).cumsum(0) - 1
    last_flat = torch.empty(len(chunks), dtype=torch.long)
    last_flat[torch.tensor(order, dtype=torch.long)] = ends
    return BatchInputs(tokens, positions, slots, decode, prefill, last_flat.to(device), new_lengths)


def _pad_tables(tables: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if len(tables) == 1:
        return tables[0][None, :]
    return torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(device)


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of each position: `table[pos // bs] * bs + pos % bs`, row-wise."""
    blocks = torch.gather(tables, 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size
