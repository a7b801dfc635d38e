"""Turning a varlen batch (prefill chunks and single-token decodes) into the tensors one forward needs.

A forward sees one flat row of tokens. Sequences are laid out decodes first
(one token each) and then prefill chunks, so the attention of each group is a
plain slice of the flat projections:

* decode group: `B` queries, one per sequence, or several for a chunk that asks
  to be answered as decodes (`SeqChunk.as_decodes`: a speculative draft, whose
  positions must come out exactly as the steps they stand for would have
  computed them); each attends to its own gathered context `[B, L]` (L = the
  longest context in the group) under a length mask, or, for the paged decode
  kernel (`decode_gather=False`), straight from the pool through its block
  table and key range;
* prefill group: `P` chunks, each attending causally to its own sequence's
  context, one SDPA call per chunk at its own length (padding every chunk to
  the longest cost up to ten times the attention work of a burst of prompts
  of different lengths); a chunk that starts a sequence with no window uses
  SDPA's own causal mode, others carry a `[len, L]` mask built here.

With a window (a model whose every layer slides by it) every context starts
at its first query's window, not at position 0: no path gathers or reads a
key no query attends to, and so none reads a page a sliding lease gave back
(`paged_kv.PagedKvStore.before_write`, which each sequence passes here
first, slides it; this module checks the first key read against it).

Everything is built once per forward and KV group (`build_group_inputs`: a
store's layers are split into groups, each with its own block tables, the
local ones' through the model's window) and shared by every layer of the
group; positions come from the store (the KV is the only cursor), and the new
tokens' slots are computed from the block tables. Inside the model the only Python loop is the
one SDPA call per prefill chunk in each layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ferrox_batch.errors import TokenOutOfVocab
from ferrox_batch.runtime.kv.group_lease import SeqKv
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """`tokens` to append to sequence `seq_id`, starting at its current KV length. `as_decodes`: each token
    is a query of the decode group at its own position (every layer writes the chunk's K/V to the pool
    before any of its queries attends), so each position's output is bit for bit what a decode step at
    that position computes; else a chunk of several tokens is a prefill chunk."""

    seq_id: Hashable
    tokens: Sequence[int]
    as_decodes: bool = False


@dataclass(slots=True)
class DecodeGroup:
    """One query per row (a sequence's decode, or one position of a chunk answered as decodes). The paged
    kernel reads `tables` within `lo .. hi - 1`; the gather path reads `ctx_slots` (flattened `[N * L]`)
    under `mask` (None: every key counts)."""

    count: int
    tables: torch.Tensor  # [N, max_blocks] int64
    lo: torch.Tensor  # [N] first key attended
    hi: torch.Tensor  # [N] one past the last key
    ctx_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class PrefillChunk:
    """One chunk's keys: the slots of positions `0 .. start + length - 1`, and its mask
    (`[length, L]`, True = attend), None when plain causal attention is exact."""

    ctx_slots: torch.Tensor
    length: int
    mask: torch.Tensor | None


@dataclass(slots=True)
class BatchInputs:
    tokens: torch.Tensor  # [T] in flat (decodes-first) order
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] where each token's K/V is written
    decode: DecodeGroup | None
    prefill: list[PrefillChunk]
    last_rows: torch.Tensor  # [S] flat row of each sequence's last token, in the caller's order
    new_lengths: list[tuple[Hashable, int]]


def build_inputs(
    chunks: Sequence[SeqChunk],
    store: PagedKvStore,
    vocab_size: int,
    sliding_window: int | None,
    decode_gather: bool = True,
) -> BatchInputs:
    """The tensors of one forward over `chunks`, through the first KV group's tables (a model of one
    kind of layer has only that group), every query attending over `sliding_window` (None: all of its
    context).

    `decode_gather=False` skips the decode group's context slots and mask (the paged kernel
    reads the tables instead).
    """
    batch = _Batch.of(chunks, store, vocab_size)
    return batch.inputs(0, sliding_window, decode_gather)


def build_group_inputs(chunks: Sequence[SeqChunk], store: PagedKvStore, vocab_size: int,
                       decode_gather: bool = True) -> list[BatchInputs]:
    """`build_inputs` for every KV group of the store, in group order: a local group's through the
    model's window, a global group's over every position. Every sequence slides (`before_write`) once."""
    batch = _Batch.of(chunks, store, vocab_size)
    window = store.config.sliding_window
    return [batch.inputs(group, window if local else None, decode_gather)
            for group, local in enumerate(store.groups.local)]


@dataclass(slots=True)
class _Batch:
    """What every group's inputs share: the flat order, the tokens, each sequence's start and length."""

    store: PagedKvStore
    order: list[int]
    n_decode: int
    tokens: torch.Tensor
    seqs: list[SeqKv]
    ids: list[Hashable]
    starts: list[int]
    lens: list[int]
    last_rows: torch.Tensor
    new_lengths: list[tuple[Hashable, int]]
    #: Whether a chunk is answered as decodes (else every decode sequence is one row).
    expanded: bool = False

    @classmethod
    def of(cls, chunks: Sequence[SeqChunk], store: PagedKvStore, vocab_size: int) -> _Batch:
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
        # Decodes first, then prefill chunks; `order[j]` is the caller's index of flat sequence j.
        order = [i for i, c in enumerate(chunks) if len(c.tokens) == 1 or c.as_decodes]
        n_decode = len(order)
        order += [i for i, c in enumerate(chunks) if len(c.tokens) > 1 and not c.as_decodes]

        flat_tokens = [token for i in order for token in chunks[i].tokens]
        tokens = torch.tensor(flat_tokens, dtype=torch.long)
        bad = (tokens < 0) | (tokens >= vocab_size)
        if bool(bad.any()):
            raise TokenOutOfVocab(int(tokens[bad.nonzero()[0, 0]]), vocab_size)
        tokens = tokens.to(device)
        seqs = [store.before_write(chunks[i].seq_id, len(chunks[i].tokens)) for i in order]  # sliding ones slide
        lens = [len(chunks[i].tokens) for i in order]
        starts = [seq.length for seq in seqs]
        ids = [chunks[i].seq_id for i in order]
        new_lengths = [(seq_id, start + length) for seq_id, start, length in zip(ids, starts, lens)]
        # Last flat row of each sequence, returned in the caller's order.
        ends = torch.tensor(lens, dtype=torch.long).cumsum(0) - 1
        last_flat = torch.empty(len(chunks), dtype=torch.long)
        last_flat[torch.tensor(order, dtype=torch.long)] = ends
        return cls(store, order, n_decode, tokens, seqs, ids, starts, lens, last_flat.to(device), new_lengths,
                   any(c.as_decodes and len(c.tokens) > 1 for c in chunks))

    def inputs(self, group: int, sliding_window: int | None, decode_gather: bool) -> BatchInputs:
        """The forward's inputs through group `group`'s tables, attending over `sliding_window`."""
        store, starts, lens, n_decode = self.store, self.starts, self.lens, self.n_decode
        device = store.device
        bs = store.block_size
        tables: list[torch.Tensor] = []
        for seq_id, seq, start in zip(self.ids, self.seqs, starts):
            table = seq.groups[group]
            # With a window, every query of the chunk reads only positions from `first` on (its first
            # query's window; later queries' windows start later), which a sliding lease never gives back:
            # checked here, on the host, so no attention path can read a page that now holds other positions.
            first = _first_key(start, sliding_window)
            if table.sliding is not None and first < table.sliding.released:
                raise ValueError(f"sequence {seq_id!r} would read position {first}, but its sliding KV lease "
                                 f"gave back the positions before {table.sliding.released}")
            # A group whose blocks span several of its own (its heads narrower than another group's) reads
            # block `b` as its own block `b * scale` (`PagedKvStore.block_scale`).
            scale = store.block_scale[group]
            tables.append(table.table if scale == 1 else table.table * scale)

        decode = None
        pos_parts: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        if n_decode:
            d_tables = _pad_tables(tables[:n_decode], device)
            rows = starts[:n_decode]
            if self.expanded:  # chunks answered as decodes: a row per position, each with its sequence's table
                rows = [start + k for start, length in zip(rows, lens[:n_decode]) for k in range(length)]
                per_seq = torch.tensor(lens[:n_decode], dtype=torch.long, device=device)
                d_tables = d_tables.repeat_interleave(per_seq, dim=0)
            d_pos = torch.tensor(rows, dtype=torch.long, device=device)
            pos_parts.append(d_pos)
            slot_parts.append(_slots(d_tables, d_pos[:, None], bs).squeeze(1))
            ctx_len = d_pos + 1
            lo = torch.zeros_like(d_pos) if sliding_window is None else (ctx_len - sliding_window).clamp(min=0)
            decode = DecodeGroup(len(rows), d_tables, lo, ctx_len)
            if decode_gather:
                # Key j of row i is position lo[i] + j: a row gathers its window only, never a position
                # before it (with no window, lo is 0 and key j is position j).
                counts = [row + 1 - _first_key(row, sliding_window) for row in rows]
                width = max(counts)
                keys = torch.arange(width, device=device)
                # Keys past a row's own position are masked, but still gathered: clamped to the row's last
                # written slot, they read its own finite KV, never stale pool memory (the store does not
                # clear leases) nor a padded table entry.
                ctx = _slots(d_tables, torch.minimum(lo[:, None] + keys[None, :], d_pos[:, None]), bs)
                mask = keys[None, :] < (ctx_len - lo)[:, None]
                # Every key of every row counts when all rows read as many keys: known from the host-side
                # starts, with no device sync for `mask.all()`.
                decode.ctx_slots = ctx.reshape(-1)
                decode.mask = None if min(counts) == width else mask[:, None, None, :]
        prefill: list[PrefillChunk] = []
        for j in range(n_decode, len(self.order)):
            start, length = starts[j], lens[j]
            width = start + length
            # The chunk's keys start at its first query's window (position 0 without a window): the context
            # is relative to `base`, which attention does not see (RoPE was applied at the absolute positions
            # when each key was written), and the prefill kernel's window arithmetic is relative too.
            base = _first_key(start, sliding_window)
            keys = torch.arange(base, width, device=device)
            ctx = _slots(tables[j][None, :], keys[None, :], bs)[0]
            qpos = keys[start - base:]
            pos_parts.append(qpos)
            slot_parts.append(ctx[start - base:])
            mask = None
            if start > base or (sliding_window is not None and width - base > sliding_window):
                mask = keys[None, :] <= qpos[:, None]
                if sliding_window is not None:
                    mask &= keys[None, :] > (qpos[:, None] - sliding_window)
            prefill.append(PrefillChunk(ctx, length, mask))

        positions = torch.cat(pos_parts)
        slots = torch.cat(slot_parts)
        return BatchInputs(self.tokens, positions, slots, decode, prefill, self.last_rows, self.new_lengths)


def _first_key(start: int, window: int | None) -> int:
    """The first position a query at `start` reads: `start + 1 - window`, or 0."""
    return 0 if window is None else max(0, start + 1 - window)


def _pad_tables(tables: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if len(tables) == 1:
        return tables[0][None, :]
    return torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(device)


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of each position: `table[pos // bs] * bs + pos % bs`, row-wise."""
    blocks = torch.gather(tables, 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size
