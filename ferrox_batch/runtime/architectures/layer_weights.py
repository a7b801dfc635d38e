"""`LayerWeights`: one decoder layer's weights as the forward and the C layer stack both read them.

Its own module because two readers share it: the decoder (`decoder`) that builds and runs the layers in
Python, and the layer stack (`layer_stack`) that binds the same weights for one C call per forward.
Neither of them imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.linear import Linear


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: GateUp
    down: Linear
