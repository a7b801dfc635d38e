"""A request's bias as it waits in the queue: compact, bounded by its own lists, scattered once at admission.

Pins:
* what `BatchSampler.prepare_bias` keeps for a queued request holds at most 8 bytes per id its lists name
  (an int32 id and a float32 value), never a `[vocab]` tensor: 512 queued requests with a one-entry
  `logit_bias` on a 262,144-id vocabulary hold kilobytes, not half a gibibyte;
* the row made from it at admission has exactly the dense bias the lists describe (`logit_bias` added, -inf
  outside `allowed_token_ids` and on one-token bad words, which win over a bias for the same id), as a
  reference built id by id says, for any lists;
* making the row does no Python work per id: the lines the interpreter runs in `new_row` are as many for a
  list of 50,000 ids as for a list of 5.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.generation_types import SamplingParams
from ferrox_batch.runtime.sampling.sampler import BatchSampler

VOCAB = 64
GEMMA_VOCAB = 262_144
#: An int32 id and a float32 value per id a list names.
BYTES_PER_ID = 8


def _tensors(value: object, seen: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `value` through slots, dicts, tuples and lists (each once)."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item, seen)
    elif hasattr(value, "__slots__") or hasattr(value, "__dict__"):
        names = [*getattr(value, "__slots__", ()), *getattr(value, "__dict__", {})]
        for name in names:
            if hasattr(value, name):
                yield from _tensors(getattr(value, name), seen)


def held_bytes(value: object) -> int:
    """The bytes of tensor storage `value` keeps alive."""
    return sum(t.untyped_storage().nbytes() for t in _tensors(value, set()))


def reference(params: SamplingParams, vocab: int) -> torch.Tensor:
    """The dense bias built id by id, as the lists' meaning says."""
    out = [0.0] * vocab
    for token, value in params.logit_bias:
        out[token] = float(torch.tensor(value, dtype=torch.float32))
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        out = [v if t in allowed else float("-inf") for t, v in enumerate(out)]
    for word in params.bad_words_ids:
        if len(word) == 1:
            out[word[0]] = float("-inf")
    return torch.tensor(out, dtype=torch.float32)


def named(params: SamplingParams) -> int:
    return len(params.token_ids_named)


lists = st.fixed_dictionaries({
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100, width=32, allow_subnormal=False),
                                  max_size=12),
    "allowed_token_ids": st.none() | st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=20).map(sorted),
    "bad_words_ids": st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2).map(tuple),
                              max_size=6).map(tuple),
})


@settings(max_examples=150, deadline=None)
@given(fields=lists)
def test_the_row_gets_the_dense_bias_its_lists_describe_from_a_form_bounded_by_them(fields: dict[str, Any]):
    sampler = BatchSampler(VOCAB, "cpu")
    params = SamplingParams(**fields)
    prepared = sampler.prepare_bias(params)
    assert held_bytes(prepared) <= BYTES_PER_ID * named(params)
    row = sampler.new_row(params, None, [], prepared=prepared)
    built = sampler.new_row(params, None, [])  # unprepared: the row builds it the same way
    want = reference(params, VOCAB)
    if not (params.logit_bias or params.allowed_token_ids is not None
            or any(len(w) == 1 for w in params.bad_words_ids)):
        assert row.bias is None and built.bias is None
        return
    assert torch.equal(row.bias, want), (row.bias, want)
    assert torch.equal(built.bias, want)


def test_queued_requests_hold_their_lists_size_not_the_vocabularys():
    sampler = BatchSampler(GEMMA_VOCAB, "cpu")
    for params in (SamplingParams(logit_bias={7: 2.0}),
                   SamplingParams(allowed_token_ids=[3, 9, GEMMA_VOCAB - 1]),
                   SamplingParams(bad_words_ids=((5,),)),
                   SamplingParams(logit_bias={3: -1.0}, allowed_token_ids=[3, 4], bad_words_ids=((4,), (8, 9)))):
        prepared = sampler.prepare_bias(params)
        # 512 such requests queued: a few kilobytes in all where a dense [vocab] each held 512 MiB.
        assert held_bytes(prepared) <= BYTES_PER_ID * named(params), (params, held_bytes(prepared))
        assert torch.equal(sampler.new_row(params, None, [], prepared=prepared).bias, reference(params, GEMMA_VOCAB))


def _lines_run(call: Any) -> int:
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def test_making_the_row_does_no_python_work_per_id():
    sampler = BatchSampler(GEMMA_VOCAB, "cpu")

    def lines_for(ids: int) -> int:
        params = SamplingParams(logit_bias={i: 1.0 for i in range(0, 2 * ids, 2)},
                                allowed_token_ids=range(0, 4 * ids, 4), bad_words_ids=((1,), (5, 6)))
        prepared = sampler.prepare_bias(params)
        return _lines_run(lambda: sampler.new_row(params, None, [], prepared=prepared))

    lines_for(5)  # first calls may import or cache: count the second
    assert lines_for(50_000) == lines_for(5)
