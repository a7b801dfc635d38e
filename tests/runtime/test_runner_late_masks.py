"""`ModelRunner` when one row's grammar mask misses the worker's deadline (a fake slow mask for that row).

Pins: the late row, in the middle of the batch, ends with `GrammarTooSlow` alone; every other row is sampled
from its own logits with its own mask (the masks' row indices remapped past the late row): each constrained
row's token is the greedy pick among what its grammar allows, and the unconstrained row's is its argmax.
A row whose grammar erred (a copy of a grammar whose shared lexer another row's costly masks exhausted) is
told its grammar's error, not that it was complete.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ferrox_batch.errors import GrammarConstraint
from ferrox_batch.forward import RowToSample
from ferrox_batch.generation_types import SamplingParams
from ferrox_batch.grammar_limits import GrammarLimits, GrammarTooSlow
from ferrox_batch.runtime.runner import ModelRunner
from ferrox_batch.runtime.sampling.grammar import Grammars
from ferrox_batch.runtime.sampling.mask_pool import MaskPool
from ferrox_batch.runtime.sampling.sampler import BatchSampler
from ferrox_batch.structured import StructuredOutput


def test_a_late_row_fails_alone_and_the_others_sample_with_their_own_masks(tiny_batch_model):
    tokenizer, vocab = tiny_batch_model.tokenizer, tiny_batch_model.config.vocab_size
    grammars = Grammars(tokenizer.inner.to_str(), vocab, sorted(tokenizer.stop_tokens.ids), limits=GrammarLimits())
    decoder = tiny_batch_model.decoder
    runner = ModelRunner(decoder, decoder.new_store(8, num_blocks=64), BatchSampler(vocab, "cpu", grammars))
    specs = [StructuredOutput.regex("a+"), StructuredOutput.regex("[0-9]+"), None, StructuredOutput.regex("z+"),
             StructuredOutput.regex("[A-Z]+")]
    late_row = 1
    sampling = [RowToSample(runner.allocate(4), i, SamplingParams(), None, None, [1, 2, 7],
                            None if spec is None else grammars.compile(spec)) for i, spec in enumerate(specs)]
    outcomes, ready = runner._rows(sampling)
    rows = [runner._samplers[s.seq_id] for s in sampling]
    slow = rows[late_row].matcher
    release = threading.Event()

    def fill(matcher: object, bits: np.ndarray, row: int) -> None:
        if matcher is slow:
            release.wait(30)
        grammars.fill_row(matcher, bits, row)

    grammars._pool = MaskPool(fill, (vocab + 31) // 32, deadline_s=0.01)
    # What each row may sample, from copies of its matcher (the sample advances the row's own).
    allowed = {j: grammars.masks([row.matcher.deep_copy()], "cpu")[0] for j, row in enumerate(rows)
               if row.matcher is not None}
    logits = torch.randn(len(specs), vocab, generator=torch.Generator().manual_seed(3))
    try:
        started = runner.sampler.start_masks(rows)
        sampled = runner._sample(sampling, logits, outcomes, ready, rows, started)
    finally:
        release.set()
        grammars.close()
    assert isinstance(sampled[late_row], GrammarTooSlow)
    for j, token in enumerate(sampled):
        if j == late_row:
            continue
        if j in allowed:
            expected = int(logits[j].masked_fill(~allowed[j], float("-inf")).argmax())
            assert allowed[j].sum() < vocab  # the mask matters: it is not everything
        else:
            expected = int(logits[j].argmax())
        assert token == expected, j


class BrokenMatcher:
    """A row's matcher that erred computing its mask (llguidance's matchers stop when they err): a shared
    lexer past its expression budget, as a copy of a grammar that another row made costly meets."""

    def is_error(self) -> bool:
        return True

    def is_stopped(self) -> bool:
        return True

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed"

    def consume_token(self, token: int) -> bool:
        raise AssertionError("an erred matcher is never fed")


def test_a_row_whose_grammar_erred_is_told_so_not_that_it_was_complete():
    outcome = BatchSampler._advance(BrokenMatcher(), 5, 5)
    assert isinstance(outcome, GrammarConstraint) and "too many expressions" in str(outcome)
    assert "already complete" not in str(outcome)
