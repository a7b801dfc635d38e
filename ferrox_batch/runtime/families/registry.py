"""The families the runtime runs: the one list a new family is added to.

Everything that must know a checkpoint's family asks here, by what it has in hand: a config's
`architectures` or `model_type`, or a GGUF file's metadata (its `general.architecture`, and for `llama` whether
it holds experts: Mixtral). Anything no family claims is an `UnsupportedArchitecture` that lists the ones
supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ferrox_batch.runtime.families import (
    gemma3,
    gemma4,
    gpt_oss,
    granite,
    granitemoe,
    llama,
    mistral,
    mixtral,
    olmo2,
    olmoe,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    smollm3,
)
from ferrox_batch.runtime.families.errors import UnsupportedArchitecture
from ferrox_batch.runtime.families.family import Family, Wrapped
from ferrox_batch.runtime.families.gguf_metadata import GgufFamily, Meta

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, smollm3.FAMILY, phi3.FAMILY, gemma3.FAMILY,
    gemma4.FAMILY, granite.FAMILY, olmo2.FAMILY, qwen3_moe.FAMILY, qwen2_moe.FAMILY, olmoe.FAMILY,
    granitemoe.FAMILY, mixtral.FAMILY, gpt_oss.FAMILY,
)

#: Hugging Face architecture -> its family.
BY_ARCHITECTURE: Mapping[str, Family] = MappingProxyType(
    {name: family for family in FAMILIES for name in family.architectures})
#: `model_type` -> its family.
BY_MODEL_TYPE: Mapping[str, Family] = MappingProxyType({family.model_type: family for family in FAMILIES})
#: llama.cpp's `general.architecture` -> how it writes that family (for `llama`, without experts).
BY_GGUF_ARCHITECTURE: Mapping[str, GgufFamily] = MappingProxyType(
    {family.gguf.arch: family.gguf for family in FAMILIES
     if family.gguf is not None and not family.gguf.experts_variant})
#: llama.cpp's `general.architecture` -> the family its files with `{arch}.expert_count` > 0 are (Mixtral).
BY_GGUF_EXPERTS_VARIANT: Mapping[str, GgufFamily] = MappingProxyType(
    {family.gguf.arch: family.gguf for family in FAMILIES
     if family.gguf is not None and family.gguf.experts_variant})


def gguf_family(metadata: Mapping[str, Any]) -> GgufFamily:
    """The family a GGUF file's metadata names: its `general.architecture`, or that architecture's variant
    with experts where `{arch}.expert_count` is positive. `ModelLoadError` for a count that is not an integer."""
    arch = metadata.get("general.architecture")
    family = BY_GGUF_ARCHITECTURE.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise UnsupportedArchitecture(str(arch), list(BY_GGUF_ARCHITECTURE))
    variant = BY_GGUF_EXPERTS_VARIANT.get(family.arch)
    if variant is not None and Meta(metadata, family.arch).integer("expert_count", 0) > 0:
        return variant
    return family


#: Checkpoints holding a family's model inside a larger one, by their architecture (`Wrapped`).
WRAPPED: Mapping[str, Wrapped] = MappingProxyType({gemma4.WRAPPED.architecture: gemma4.WRAPPED})


def wrapped_of(raw: Mapping[str, Any]) -> Wrapped | None:
    """How the checkpoint `raw` (a `config.json`) wraps a family's model; None where it is the model itself."""
    archs = raw.get("architectures") or []
    return WRAPPED.get(str(archs[0])) if archs else None


def supported_architectures() -> list[str]:
    return sorted(BY_ARCHITECTURE)


def family_of_architecture(architecture: str) -> Family:
    """The family of a Hugging Face architecture name (`LlamaForCausalLM`)."""
    family = BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise UnsupportedArchitecture(architecture, supported_architectures())
    return family


def family_of_config(raw: Mapping[str, Any]) -> Family:
    """The family a `config.json` names: its first `architectures` entry, else its `model_type`."""
    archs = raw.get("architectures") or []
    if archs:
        return family_of_architecture(str(archs[0]))
    model_type = raw.get("model_type")
    family = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedArchitecture(str(model_type), supported_architectures())
    return family


def family_of_model_type(model_type: str) -> Family:
    family = BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise UnsupportedArchitecture(model_type, sorted(BY_MODEL_TYPE))
    return family
