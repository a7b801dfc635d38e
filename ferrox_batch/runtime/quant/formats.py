"""The quantized block formats the runtime serves as stored, as llama.cpp lays them out.

A quantized weight is stored row by row, each row of `k` inputs a run of blocks of `block_elems`
weights, each block `block_bytes` long (its scales and its packed integers). These are the formats
users download GGUF files in: Q8_0 (8 bits, one scale per 32), Q4_0 and Q4_1 (4 bits, a scale, and
for Q4_1 a minimum, per 32), Q5_0 (5 bits per 32), and the K-quants Q4_K and Q6_K (super-blocks of
256 with scales per 32 or per 16 quantized in turn). A Q4_K_M file mixes the last two; Gemma 3 270M's
uses Q5_0, Q4_K, Q6_K and Q8_0. MXFP4 (4-bit floats, E2M1, with a power-of-two E8M0 scale per 32) is
what gpt-oss's experts are published in, and llama.cpp's files keep them so (`quant.mxfp4` converts the
published safetensors' blocks to it). `ggml_type` is GGML's type number, what the file and the C kernels
(`csrc/quant_gemm.c`) name a format by.

Promises: `FORMATS` holds exactly the formats the kernels run; `row_bytes` is the bytes of one row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: str
    ggml_type: int
    #: Weights per block (32, or 256 for a K-quant's super-block).
    block_elems: int
    #: Bytes per block.
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_elems

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` weights; `k` must be a whole number of blocks."""
        if k <= 0 or k % self.block_elems:
            raise ValueError(f"{self.name} stores rows in blocks of {self.block_elems} weights; a row of {k} "
                             f"is not a whole number of them")
        return k // self.block_elems * self.block_bytes


#: Every format served as stored, by its lower-case name (what `--weights` and `/stats` say).
FORMATS: Mapping[str, QuantFormat] = MappingProxyType({f.name: f for f in (
    QuantFormat("q8_0", 8, 32, 34),
    QuantFormat("q4_0", 2, 32, 18),
    QuantFormat("q4_1", 3, 32, 20),
    QuantFormat("q5_0", 6, 32, 22),
    QuantFormat("q4_k", 12, 256, 144),
    QuantFormat("q6_k", 14, 256, 210),
    QuantFormat("mxfp4", 39, 32, 17),
)})

#: The same formats by GGML type number.
BY_GGML_TYPE: Mapping[int, QuantFormat] = MappingProxyType({f.ggml_type: f for f in FORMATS.values()})
