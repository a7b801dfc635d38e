"""No attention path reads a page a sliding lease gave back (`runtime.kv.batch_inputs`, D8).

A sliding lease keeps the pages behind its window as spares and writes later positions into them, so a
read through an old position would see another position's keys. Here every spare page is filled with NaN
after each forward, on the C kernels and on torch's gather path, through a prompt prefilled in chunks (each
chunk slides) and decode steps that slide every 4 steps (and through the C layer loop where it binds): the logits stay finite and equal, step for step,
those of an ordinary lease that keeps every position. A read through a released table entry would not
even reach the pool: the entry is negative, which the gather and the kernels' range checks refuse.
"""

from __future__ import annotations

import pytest
import torch

from ferrox_batch.admission.window import WindowPolicy
from ferrox_batch.runtime.kernels.cpu_kernels import cpu_kernels
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.kv.sliding import RELEASED
from ferrox_batch.runtime.loading.loader import load_model

PROMPT = [(7 * i + 3) % 300 for i in range(45)]
STEPS = 60


@pytest.mark.parametrize("dtype,kernels", [("float32", True), ("float32", False), ("fp16w", True)])
def test_pages_given_back_are_never_read_again(tiny_variant_dirs, device, dtype, kernels):
    """fp16w runs the whole layer loop in one C call where the machine has the fp16 panel kernels."""
    if kernels and (device != "cpu" or cpu_kernels() is None):
        pytest.skip("the C kernels run on a CPU that has them")
    model = load_model(tiny_variant_dirs["mistral-window"], device=device, dtype=dtype)
    window = model.config.uniform_window
    assert window == 7
    if not kernels:
        model.decoder.kernels = None  # torch's gather path, as on CUDA
    decoder = model.decoder
    plain = decoder.new_store(4, num_blocks=64)
    plain.add_sequence("s", len(PROMPT) + STEPS)
    sliding = decoder.new_store(4, num_blocks=64)
    sliding.kv.fill_(float("nan"))
    sliding.add_sequence("s", 48, window=WindowPolicy(window, 4, 4))  # 12 blocks for 105 positions

    def poison_spares() -> None:
        for block in sliding.seq("s").sliding.spare:
            sliding.kv[:, block * 4:(block + 1) * 4] = float("nan")

    def step(tokens: list[int]) -> torch.Tensor:
        want = decoder.forward([SeqChunk("s", tokens)], plain)[0]
        got = decoder.forward([SeqChunk("s", tokens)], sliding)[0]
        poison_spares()
        assert bool(got.isfinite().all())
        assert torch.equal(got, want)
        return want

    for start in range(0, len(PROMPT), 10):
        logits = step(PROMPT[start:start + 10])
    for _ in range(STEPS - 1):
        logits = step([int(logits.argmax())])
    seq = sliding.seq("s")
    assert seq.length == len(PROMPT) + STEPS - 1 and seq.sliding.released >= seq.length - window - 2 * 4 - 4
    assert seq.table.tolist().count(RELEASED) == seq.sliding.released // 4 > 20
