"""What a compiled grammar's first masks cost, measured on the caller's thread before its request is queued.

A grammar's build is bounded by llguidance's own limits (`runtime.sampling.grammar`), but its masks are not:
no llguidance limit bounds the forced-token search a regex such as `(x{600}){600}` sets off (its step lexer
fuel and item limits count other work), which costs 0.5-1 s for the first mask and 0.1 s for each later
one. So the compile computes the grammar's first masks itself, on a copy, and reports the CPU time they
took. Its path: the highest allowed id each time (in a BPE vocabulary the longest merges, as a model
writes them: `{"a":"` as `{"`, `a`, `":"`, where another path to the same text can take the lexer
elsewhere). Only llguidance calls that drop the GIL are used (`compute_bitmask` and `compute_ff_tokens`
hold it: a second of them would stop every Python thread, the worker's too): the caller's thread CPU time, which llguidance spends
on the calling thread (a machine busy with other work does not make a cheap grammar look costly).
"""

from __future__ import annotations

import time

import llguidance
import llguidance.numpy
import numpy as np


def first_masks_cpu_s(start: llguidance.LLMatcher, vocab_size: int, masks: int, budget_s: float) -> float:
    """CPU seconds of the first `masks` masks of `start`'s grammar (on a copy; `start` is not advanced),
    stopping early once past `budget_s` or where the grammar ends or errs."""
    matcher = start.deep_copy()
    spent = 0.0
    bits = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    for _ in range(masks):
        began = time.thread_time()
        llguidance.numpy.fill_next_token_bitmask(matcher, bits, 0)  # drops the GIL, unlike compute_bitmask
        spent += time.thread_time() - began
        if spent > budget_s or matcher.is_error() or matcher.is_stopped():
            break
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab_size])
        if allowed.size == 0 or not matcher.consume_token(int(allowed[-1])) or matcher.is_stopped():
            break
    return spent
