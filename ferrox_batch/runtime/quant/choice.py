"""Choosing how a checkpoint's weights are held, the same way on every start: `--weights`.

* `auto` (the default): a GGUF file is served in the quantized formats it stores (`formats.FORMATS`), on
  the CPU, where the quantized kernels run; its other tensors (norms, f16 or bf16 weights, types the
  kernels do not run) are widened to the precision. A safetensors checkpoint keeps its dense weights, and
  the quantized ones it stores in such a format (gpt-oss's published MXFP4 experts) as a GGUF's. On
  CUDA every weight is widened: the quantized kernels are the CPU's.
* `widen`: every weight widened to the precision, as a dense checkpoint is held (the reference the
  quantized formats are measured against).
* `q8_0`, `q4_0`, `q4_1`, `q5_0`: every linear weight and the embedding quantized to that format at load
  (`quantize`), from whatever the checkpoint stores; a CPU option.

The precision (`--dtype`) still decides the activations and what stays dense; a choice carries its
reason, which the loader logs beside the precision's. Quantized weights are multiplied with int8
activations and integer dot products by default (llama.cpp's arithmetic; each row's result is independent
of its batch); `int8_activations=False` keeps x in the precision and decodes the weights to float32 instead
(the weight-only kernel: the widened weights' product exactly, up to summation order; slower).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox_batch.runtime.quant.formats import QuantFormat
from ferrox_batch.runtime.quant.quantize import LOAD_FORMATS, load_format

#: The `quantization_config.quant_method`s of safetensors checkpoints whose weights are in one of our
#: formats, served as stored (gpt-oss's published MXFP4 experts, `families.gpt_oss`).
STORED_QUANT_METHODS: frozenset[str] = frozenset({"mxfp4"})
#: Every `--weights` value.
WEIGHTS_CHOICES: tuple[str, ...] = ("auto", "widen", *LOAD_FORMATS)


@dataclass(frozen=True, slots=True)
class WeightsChoice:
    #: Serve the checkpoint's quantized tensors in their stored formats (where the kernels run them).
    keep_quantized: bool
    #: Quantize every dense 2-D weight to this format at load.
    quantize_to: QuantFormat | None
    reason: str
    #: Multiply quantized weights with int8 activations (else the weight-only kernel).
    int8_activations: bool = True


def choose_weights(asked: str | None, *, gguf: bool, device: torch.device, int8_activations: bool = True,
                   stores_quantized: bool = False) -> WeightsChoice:
    """How to hold the weights of a checkpoint (a `gguf` file or not; a safetensors one that
    `stores_quantized` weights in a format of ours) on `device` (module docstring)."""
    choice = _choose(asked, gguf=gguf, device=device, stores_quantized=stores_quantized)
    if int8_activations:
        return choice
    return WeightsChoice(choice.keep_quantized, choice.quantize_to,
                         choice.reason + "; quantized weights multiplied by the weight-only kernel", False)


def _choose(asked: str | None, *, gguf: bool, device: torch.device, stores_quantized: bool) -> WeightsChoice:
    asked = asked or "auto"
    if asked not in WEIGHTS_CHOICES:
        raise ValueError(f"unknown weights choice {asked!r}; use one of {', '.join(WEIGHTS_CHOICES)}")
    if asked == "widen":
        return WeightsChoice(False, None, "asked for: every weight widened to the precision")
    if asked != "auto":
        if device.type != "cpu":
            raise ValueError(f"--weights {asked} quantizes for the CPU's kernels; on {device.type} use auto or widen")
        return WeightsChoice(False, load_format(asked), f"asked for: every linear weight and the embedding "
                                                        f"quantized to {asked} at load")
    if not gguf and not stores_quantized:
        return WeightsChoice(False, None, "auto: a safetensors checkpoint keeps its dense weights")
    what = "GGUF" if gguf else "checkpoint"
    if device.type != "cpu":
        return WeightsChoice(False, None, f"auto on {device.type}: the quantized kernels are the CPU's, so the "
                                          f"{what}'s quantized weights are widened to the precision")
    return WeightsChoice(True, None, f"auto: a {what} is served in the quantized formats it stores")
