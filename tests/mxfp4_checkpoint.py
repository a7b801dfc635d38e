"""A tiny gpt-oss written as the published checkpoints are: its experts as MXFP4 `*_blocks` / `*_scales` pairs.

`ggml_rows` rounds `[..., out, in]` weights to MXFP4 with gguf-py's quantizer (one E8M0 exponent and 32 FP4
codes a block, GGML's `block_mxfp4`); `published_pair` moves those rows' nibbles to the published layout
(byte i holding codes 2i and 2i + 1), the inverse of `quant.mxfp4.ggml_nibbles`. `write_published` turns a
tiny gpt-oss in transformers' layout into the published checkpoint (`quantization_config: {quant_method:
mxfp4}`, everything but the experts in bf16) and its float twin: the same bf16 values, and the experts
as transformers' own MXFP4 dequantization (`convert_moe_packed_tensors`) gives them, in its layout. So
transformers running the twin runs exactly the values the published checkpoint stores.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

#: What the published gpt-oss configs leave unconverted beside the experts.
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@dataclass(slots=True)
class Published:
    folder: Path  # the published layout
    twin: Path  # the same values, dequantized, in transformers' float layout
    blocks_bytes: int  # every expert weight's blocks and scales


def ggml_rows(weight: torch.Tensor) -> torch.Tensor:
    """`[..., out, in]` float weights rounded to MXFP4: GGML rows `[..., out, in / 32 * 17]`."""
    values = weight.float().numpy()
    raw = gguf_quantize(values.reshape(-1, values.shape[-1]), GGMLQuantizationType.MXFP4)
    return torch.from_numpy(np.ascontiguousarray(raw)).reshape(*weight.shape[:-1], -1)


def published_pair(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML MXFP4 rows as the published `(blocks [..., in / 32, 16], scales [..., in / 32])`."""
    groups = rows.reshape(*rows.shape[:-1], -1, 17)
    codes = torch.cat((groups[..., 1:] & 15, groups[..., 1:] >> 4), dim=-1)  # element j of the block, in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), groups[..., 0].contiguous()


def write_published(source: Path, out: Path) -> Published:
    """The tiny gpt-oss in `source` (transformers' layout) as `out/published` and `out/twin`."""
    tensors = load_file(str(source / "model.safetensors"))
    published: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    blocks_bytes = 0
    for name, value in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # transformers holds [experts, in, out]; the published blocks are [experts, out, in / 32, 16]
            blocks, scales = published_pair(ggml_rows(value.transpose(1, 2)))
            published[f"{name}_blocks"], published[f"{name}_scales"] = blocks, scales
            twin[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
            blocks_bytes += blocks.numel() + scales.numel()
        else:
            published[name] = value.to(torch.bfloat16)
            twin[name] = published[name].float()
    for folder, weights in (("published", published), ("twin", twin)):
        (out / folder).mkdir(parents=True)
        for item in source.iterdir():
            if item.name != "model.safetensors":
                shutil.copy(item, out / folder / item.name)
        save_file(weights, str(out / folder / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (out / "published" / "config.json").write_text(json.dumps(config, indent=2))
    return Published(out / "published", out / "twin", blocks_bytes)
