"""MXFP4 weights as the published safetensors store them, turned into GGML's `block_mxfp4` rows.

gpt-oss's checkpoints keep their experts' weights in MXFP4 as two tensors per projection: `*_blocks`,
uint8 `[experts, out, in / 32, 16]` (32 FP4 codes per 16 bytes), and `*_scales`, uint8 `[experts, out,
in / 32]` (one E8M0 exponent per 32). Their rows are the layer's output rows (`[out, in]`, not transposed;
gate_up's gate and up rows interleaved, gate first, as stored). transformers' own dequantization
(`integrations/mxfp4.py`) reads byte i of a block as codes 2i (low nibble) and 2i + 1 (high nibble), each
code an FP4 value of {0, 0.5, 1, 1.5, 2, 3, 4, 6} with bit 3 the sign, times 2^(e - 127).

GGML's `block_mxfp4` (`formats.FORMATS["mxfp4"]`, 17 bytes) is the same exponent byte, then 16 bytes
whose byte j holds codes j (low nibble) and j + 16 (high), read with the values doubled and the scale
halved: the same numbers. So the conversion copies each exponent and moves each code to its GGML nibble,
a lossless permutation of the block's nibbles; the weight's values are transformers', bit for bit in
float32 (a code 8, FP4's -0, is GGML's +0: equal as numbers, not as bits).

E8M0 calls 255 NaN; llama.cpp, gguf-py and transformers all read it as 2^128 instead, and so do the
kernels here. A block whose values would then overflow float32 (|value| >= 2^128: e = 255 with any code
above 0.5, 254 above 1.5, 253 above 3) would be infinities on every path, so the conversion refuses it.

Promises: `from_blocks` returns a QuantizedWeight of one MXFP4 segment (stacked when the blocks have an
experts dimension) whose dequantization equals transformers' dequantization of the same tensors (as
`[out, in]` rows), or raises ValueError saying why it cannot (dtype, shapes, an overflowing block).
"""

from __future__ import annotations

import torch

from ferrox_batch.runtime.quant.formats import FORMATS
from ferrox_batch.runtime.quant.weight import QuantizedWeight

MXFP4 = FORMATS["mxfp4"]
#: The doubled FP4 magnitudes by code & 7 (llama.cpp's `kvalues_mxfp4`, unsigned): increasing with the code.
DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12)
#: The largest float32 is just below 2^128: a value at or above it is an infinity.
OVERFLOW_EXPONENT = 128


def from_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """The published `(*_blocks, *_scales)` pair, `[experts, out, in / 32, 16]` and `[experts, out, in / 32]`
    uint8 (or without the experts dimension, one 2-D weight), as GGML MXFP4 rows `[experts, out, in]`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() not in (3, 4) or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks are [(experts,) out, in / 32, 16] with scales [(experts,) out, in / 32]; "
                         f"got {tuple(blocks.shape)} and {tuple(scales.shape)}")
    if blocks.shape[-2] == 0 or blocks.shape[-3] == 0:
        raise ValueError(f"an MXFP4 weight has rows of at least one block; got {tuple(blocks.shape)}")
    blocks, scales = blocks.detach().cpu(), scales.detach().cpu()
    _refuse_overflow(blocks, scales)
    stacked = blocks.dim() == 4
    lead = blocks.shape[:-2]
    groups = blocks.shape[-2]
    out = torch.empty(*lead, groups, MXFP4.block_bytes, dtype=torch.uint8)
    # Expert by expert (or the one weight), so the nibble shuffle's temporaries stay one expert's size.
    for index in range(blocks.shape[0]) if stacked else (None,):
        src = blocks if index is None else blocks[index]
        dst = out if index is None else out[index]
        dst[..., 0] = scales if index is None else scales[index]
        dst[..., 1:] = ggml_nibbles(src)
    data = out.reshape(*lead, groups * MXFP4.block_bytes)
    return QuantizedWeight.of(MXFP4, data, 32 * groups, experts=blocks.shape[0] if stacked else None)


def ggml_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`[..., 16]` bytes holding codes 2i | 2i + 1 << 4 (transformers' order) as bytes holding codes
    i | i + 16 << 4 (GGML's)."""
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 32)
    return codes[..., :16] | (codes[..., 16:] << 4)


def _refuse_overflow(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError where a block's largest value, doubled code times 2^(e - 128), is 2^128 or more. Only e of
    253 and above can overflow (12 * 2^124 is finite), so only those blocks are looked at."""
    risky = scales >= 253
    if not bool(risky.any()):
        return
    magnitude = torch.maximum(blocks[risky] & 7, (blocks[risky] >> 4) & 7).amax(dim=-1).long()
    doubled = torch.tensor(DOUBLED, dtype=torch.float64)[magnitude]
    exponent = scales[risky].double() - 128
    bad = doubled * torch.pow(2.0, exponent) >= 2.0 ** OVERFLOW_EXPONENT
    if bool(bad.any()):
        where = risky.nonzero()[bad.nonzero()[0, 0]].tolist()
        raise ValueError(f"MXFP4 block {where} (index into the scales) would dequantize to infinity: its scale "
                         f"2^{int(scales[tuple(where)]) - 127} times its largest code overflows float32")
