"""Mistral: the Llama layer with every layer attending over one sliding window (`sliding_window`).

llama.cpp writes Mistral's dense checkpoints as `llama` files, so it has no GGUF architecture of its own.
"""

from __future__ import annotations

from ferrox_batch.runtime.families import llama
from ferrox_batch.runtime.families.family import Family

FAMILY = Family(model_type="mistral", architectures=("MistralForCausalLM",), layer=llama.layer)
