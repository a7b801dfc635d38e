"""Which module builds each family's layers: the one place a new family is registered.

Every family the config accepts (`config.SUPPORTED_ARCHITECTURES`) has its layer builder here; the decoder
asks for it by the config's family and never names a family itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from ferrox_batch.runtime.architectures import gemma3, llama, phi3, qwen3
from ferrox_batch.runtime.architectures.layer_weights import LayerWeights
from ferrox_batch.runtime.config import ModelConfig

LayerBuilder = Callable[[llama.Take, ModelConfig, int, llama.MakeLinear, llama.MakeGateUp], LayerWeights]

#: Family -> the function that builds its layer `i` from the checkpoint.
LAYERS: Mapping[str, LayerBuilder] = MappingProxyType({
    "llama": llama.layer,
    "mistral": llama.layer,
    "qwen2": llama.layer,
    "smollm3": llama.layer,
    "qwen3": qwen3.layer,
    "phi3": phi3.layer,
    "gemma3_text": gemma3.layer,
})

#: Family -> what its checkpoint's RMSNorm weights are offsets from (Gemma 3 stores `weight - 1`): added to the
#: final norm's weights at load, as each family's layer builder does for its layers' norms.
NORM_OFFSETS: Mapping[str, float] = MappingProxyType({"gemma3_text": 1.0})
