"""Whether each request's answer is the same alone or batched: `--batch-invariant auto|on|off|narrow`.

A row's logits are batch-invariant when every kernel computes that row from that row alone, in an order
that does not depend on the other rows. The norms, RoPE and the attention kernels are row-wise already;
the linear layers decide it. Ours are (the fp16-weight, bf16 and int8 quantized kernels); oneDNN's are
not: it picks its kernel, and with it each sum's order, by the batch's row count, so a greedy answer can
change with the traffic around it.

* `on`: dense bf16 linears run our bf16 kernel, and the load fails (ModelLoadError) unless every linear
  then runs a batch-invariant kernel: fp32 dense weights (oneDNN), the weight-only quantized kernel,
  fbgemm's fp16 GEMM and CUDA have none here.
* `auto` (the default): the same preference where it costs nothing measured: dense bf16 linears run our
  kernel unless the CPU has AMX, whose tile kernels oneDNN runs at prefill batch sizes and ours do not
  use. There oneDNN runs the layers, and each layer also holds its weight in our kernel's panels for the
  narrow steps (a single stream, a few concurrent ones), which the layer stack runs in one C call
  (`Linear`'s `narrow_panels`): their speed for a second copy of the layers' weights. The load then
  reports whether every linear is invariant; nothing fails.
* `off`: oneDNN for dense bf16 (the fp16-weight and quantized kernels are invariant regardless).
* `narrow`: what `auto` picks on an AMX CPU, on any CPU: oneDNN for dense bf16, and the second copy for the
  narrow steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox_batch.runtime.device import CpuFeatures

#: Every `--batch-invariant` value.
BATCH_INVARIANT_CHOICES = ("auto", "on", "off", "narrow")


@dataclass(frozen=True, slots=True)
class InvarianceChoice:
    #: Ask the decoder for our batch-invariant kernels where it has a choice (dense bf16 linears).
    prefer: bool
    #: Fail the load unless every linear layer ends up batch-invariant.
    required: bool
    reason: str
    #: Where oneDNN runs dense bf16 layers, also hold them in our kernel's panels for the narrow steps.
    narrow_panels: bool = False


def batch_invariant_choice(asked: str | bool | None) -> str:
    """`asked` as one of `BATCH_INVARIANT_CHOICES` (a bool is on or off, None auto); ValueError otherwise."""
    if isinstance(asked, bool):
        return "on" if asked else "off"
    if asked is None:
        return "auto"
    if asked not in BATCH_INVARIANT_CHOICES:
        raise ValueError(f"unknown batch-invariant choice {asked!r}; use one of {', '.join(BATCH_INVARIANT_CHOICES)}")
    return asked


def choose_batch_invariance(asked: str | bool | None, dtype: torch.dtype, device: torch.device,
                            features: CpuFeatures | None = None) -> InvarianceChoice:
    """What `asked` (a `BATCH_INVARIANT_CHOICES` value, a bool, or None for auto) means for a decoder computing
    in `dtype` on `device` (module docstring); `features` defaults to the running CPU's."""
    asked = batch_invariant_choice(asked)
    if asked == "off":
        return InvarianceChoice(False, False, "asked off: dense bf16 linears run oneDNN's kernels")
    if device.type != "cpu":
        if asked in ("on", "narrow"):
            raise ValueError(f"--batch-invariant {asked} needs the CPU's kernels; on {device.type} use auto or off")
        return InvarianceChoice(False, False, f"auto on {device.type}: the batch-invariant kernels are the CPU's")
    if asked == "on":
        return InvarianceChoice(True, True, "asked on: every linear layer must run a batch-invariant kernel")
    if asked == "narrow":
        return InvarianceChoice(False, False, "asked narrow: oneDNN runs dense bf16 layers, our bf16 kernel a second "
                                              "copy of them for the narrow steps", narrow_panels=True)
    cpu = features if features is not None else CpuFeatures.probe()
    if dtype == torch.bfloat16 and cpu.amx:
        return InvarianceChoice(False, False, "auto: this CPU has AMX, whose tile kernels oneDNN runs for large "
                                              "bf16 batches; our bf16 kernel does not use them, so it runs only the "
                                              "narrow steps, over a second copy of the layers' weights "
                                              "(--batch-invariant on trades that speed for the same answer alone or "
                                              "batched, with one copy)", narrow_panels=True)
    return InvarianceChoice(True, False, "auto: dense bf16 linears run our batch-invariant kernel (as fast as "
                                         "oneDNN's without AMX)")
