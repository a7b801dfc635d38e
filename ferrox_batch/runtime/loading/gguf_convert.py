"""Turn a llama.cpp GGUF file into the pieces of a Hugging Face checkpoint folder.

Checkpoints reach us as quantized GGUFs (the default model, Gemma 3 270M), while the runtime (and
transformers, which the tests compare against) read HF folders. This module runs the conversion: it
dequantizes every tensor to fp32 (any type `gguf.quants.dequantize` reads, K-quants included), renames it
to its HF name, undoes what llama.cpp did to its values (the Q/K row permutation of the Llama-style
families, the one added to Gemma's norms), stacks a fused tensor the file stores as its parts (Phi-3's
Q/K/V), gives a mixture of experts' stacked 3-D tensors under the STACKED layout's names, and derives
`config.json`, `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`.
What each architecture stores where is `runtime.families`'; the tokenizer is `gguf_tokenizer`'s.

Promises: `read_gguf` returns fp32 arrays under HF names with HF shapes, or raises `ModelLoadError`
(`UnsupportedArchitecture` for an architecture outside `SUPPORTED_GGUF_ARCHITECTURES`) with a message
naming the file and the problem. It never touches the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.errors import ModelLoadError, UnsupportedArchitecture
from ferrox_batch.runtime.families.family import Family
from ferrox_batch.runtime.families.gguf_metadata import GgufFamily
from ferrox_batch.runtime.families.moe_layers import STACKED
from ferrox_batch.runtime.families.moe_spec import MoeSpec
from ferrox_batch.runtime.families.registry import BY_GGUF_ARCHITECTURE, family_of_model_type, gguf_family
from ferrox_batch.runtime.loading.gguf_tokenizer import eog_ids, tokenizer_from_metadata
from ferrox_batch.runtime.quant.formats import BY_GGML_TYPE
from ferrox_batch.runtime.quant.weight import QuantizedWeight, cat_rows

SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(BY_GGUF_ARCHITECTURE)

# (done, total, tensor or file name): called after each slow step.
Progress = Callable[[int, int, str], None]


@dataclass(slots=True)
class ConvertedCheckpoint:
    """Everything an HF folder holds, in memory; `tensors` are fp32 under HF names (or, read with
    `keep_quantized`, some of them `QuantizedWeight`s)."""

    config: dict[str, Any]
    tensors: dict[str, np.ndarray | QuantizedWeight]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


def read_gguf(path: str | Path, *, progress: Progress | None = None, keep_quantized: bool = False) -> ConvertedCheckpoint:
    """Convert the GGUF at `path`; `progress` is told about each dequantized tensor. With `keep_quantized`,
    every 2-D weight, and every stack of experts' weights, stored in one of `runtime.quant.formats.FORMATS`
    stays in its blocks, copied into memory as a `QuantizedWeight` (its rows reordered where llama.cpp
    permuted them, exactly: rows are independent), and only the rest is dequantized."""
    import gguf  # deferred: only conversion needs it

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no GGUF file at {path}")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as err:  # the reader raises ValueError, struct or mmap errors alike
        raise ModelLoadError(f"{path} is not a readable GGUF file: {err}") from None
    try:
        meta = {name: _field_value(field) for name, field in reader.fields.items()
                if not name.startswith("GGUF.")}
    except (IndexError, UnicodeDecodeError, ValueError) as err:
        raise ModelLoadError(f"{path}: unreadable metadata ({err})") from None
    if meta.get("general.architecture") not in BY_GGUF_ARCHITECTURE:
        raise UnsupportedArchitecture(str(meta.get("general.architecture")), list(SUPPORTED_GGUF_ARCHITECTURES))
    try:
        family = gguf_family(meta)
        by_name = {t.name: t for t in reader.tensors}
        config_tensors = {name[:-len(".weight")]: _dequantized(by_name[name]) for name in by_name
                          if family.hf_name(name) is None}
        config = family.config(meta, set(by_name), config_tensors)
        config["vocab_size"] = _embedding_rows(by_name)
        config.update(dict.fromkeys(family.vocab_fields, config["vocab_size"]))
        _token_ids(meta, config)
        tokenizer_json, tokenizer_config = tokenizer_from_metadata(meta, config)
        tensors = _tensors(reader.tensors, family, config, progress, keep_quantized)
    except ModelLoadError as err:
        raise ModelLoadError(f"{path}: {err}") from None
    except (KeyError, ValueError, TypeError, IndexError, NotImplementedError) as err:
        raise ModelLoadError(f"{path}: malformed GGUF ({type(err).__name__}: {err})") from None
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eog_ids(meta),
                  "pad_token_id": config.get("pad_token_id")}
    return ConvertedCheckpoint(config, tensors, tokenizer_json, tokenizer_config,
                               {k: v for k, v in generation.items() if v is not None})


def write_hf_folder(ckpt: ConvertedCheckpoint, out_dir: str | Path,
                    progress: Progress | None = None) -> list[Path]:
    """Write the five files of an HF folder into `out_dir` (created), each fsynced.

    Not atomic by itself: `fetch` writes into a temporary folder and renames it.
    """
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = {
        "config.json": _dumps(ckpt.config),
        "generation_config.json": _dumps(ckpt.generation_config),
        "tokenizer_config.json": _dumps(ckpt.tokenizer_config),
        "tokenizer.json": ckpt.tokenizer_json,
    }
    total, written = len(texts) + 1, []
    for done, (name, text) in enumerate(texts.items(), 1):
        written.append(out / name)
        written[-1].write_text(text, encoding="utf-8")
        fsync_path(written[-1])
        if progress:
            progress(done, total, name)
    weights = out / "model.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in ckpt.tensors.items()}, str(weights),
              metadata={"format": "pt"})
    os.chmod(weights, 0o644)  # safetensors creates it owner-only; the other files are 0644
    fsync_path(weights)
    if progress:
        progress(total, total, weights.name)
    return [*written, weights]


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `reshape(n_head, 2, d/2, ...).swapaxes(1, 2)` on Q/K rows.

    llama.cpp interleaves the two rotary halves of each head; HF keeps them as
    contiguous halves (rotate_half), so the stored rows must be put back.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot split {rows} rows into {n_head} rotary heads")
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantized(tensor: Any) -> np.ndarray:
    """One tensor as fp32 in its HF shape (GGUF lists dimensions fastest-first)."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, a type gguf-py "
                             f"cannot dequantize") from None
    return np.array(values, dtype=np.float32).reshape(shape)


def _embedding_rows(by_name: dict[str, Any]) -> int:
    """The vocabulary the model has: the embedding's rows (the tokenizer may name fewer ids)."""
    if "token_embd.weight" not in by_name:
        raise ModelLoadError("the file has no token_embd.weight")
    return int(by_name["token_embd.weight"].shape.tolist()[-1])


def _token_ids(meta: dict[str, Any], config: dict[str, Any]) -> None:
    for field in ("bos", "eos", "padding"):
        value = meta.get(f"tokenizer.ggml.{field}_token_id")
        if value is not None:
            config["pad_token_id" if field == "padding" else f"{field}_token_id"] = int(value)
    config.setdefault("bos_token_id", None)


def _tensors(gguf_tensors: list[Any], family: GgufFamily, config: dict[str, Any],
             progress: Progress | None, keep_quantized: bool = False) -> dict[str, np.ndarray | QuantizedWeight]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weights = [t for t in gguf_tensors if family.hf_name(t.name) is not None]
    out: dict[str, np.ndarray | QuantizedWeight] = {}
    parts: dict[str, dict[int, np.ndarray | QuantizedWeight]] = {}  # a fused tensor's parts, by place
    for done, t in enumerate(weights, 1):
        name = family.hf_name(t.name)
        assert name is not None
        fmt = BY_GGML_TYPE.get(int(t.tensor_type))
        if keep_quantized and fmt is not None and len(t.shape) in (2, 3):
            # [rows, row_bytes] ([experts, rows, row_bytes]): the file's blocks, reordered below by whole rows
            weight = np.asarray(t.data)
        else:
            weight = _dequantized(t)
        if family.permuted_qk and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            weight = unpermute_rope_rows(weight, heads)
        elif family.permuted_qk and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            weight = unpermute_rope_rows(weight, kv_heads)
        if family.norm_offset and family.is_norm(t.name):
            # Back to the offset from one that HF checkpoints store (the layer adds it again at load).
            weight = weight - np.float32(family.norm_offset)
        if weight.dtype == np.uint8:
            dims = [int(d) for d in t.shape.tolist()]  # fastest first: [cols, rows] or [cols, rows, experts]
            weight = QuantizedWeight.of(fmt, weight.reshape(-1, fmt.row_bytes(dims[0])), dims[0],
                                        experts=dims[2] if len(dims) == 3 else None)
        part = family.part(t.name)
        if part is not None:
            parts.setdefault(name, {})[part[0]] = weight
            if len(parts[name]) == part[1]:
                weight = _stacked([parts[name][i] for i in range(part[1])])
        if name in out:
            raise ModelLoadError(f"tensor {t.name} appears twice")
        if part is None or len(parts[name]) == part[1]:
            out[name] = weight
        if progress:
            progress(done, len(weights), name)
    # The tensors the family's layers read at this config (the same specs the decoder builds from).
    model, shape_of = family_of_model_type(family.model_type), ModelConfig.from_dict(config)
    expected = _expected_tensors(model, shape_of)
    for name, shape in expected.items():
        held = out.get(name)
        if isinstance(held, np.ndarray) and len(shape) == 2 and shape[0] == 1 and held.shape == shape[1:]:
            out[name] = held.reshape(shape)  # a [1, n] gate llama.cpp reads as {n}, written 1-D
    # What a layer may hold and not read (a K/V-sharing layer's own K/V projections, which the converter writes
    # where the source has them and llama.cpp leaves unread too): passed on, for the decoder to drop.
    unread = {spec.prefix + name: shape for spec in model.layers(shape_of)
              for name, shape in getattr(spec.mixer, "unread", ()) if spec.prefix + name in out}
    _check_shapes(out, {**expected, **unread}, family)
    return out


def _expected_tensors(family: Family, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the file must give: the family's, its mixtures of experts in the STACKED layout (the one
    llama.cpp's stacked `ffn_*_exps` tensors are)."""
    out = family.tensors(config)
    for spec in family.layers(config):
        if isinstance(spec.ffn, MoeSpec):
            for name in spec.ffn.tensors():
                del out[spec.prefix + name]
            out.update({spec.prefix + name: shape for name, shape in spec.ffn.tensors(STACKED).items()})
    return out


def _stacked(parts: list[np.ndarray | QuantizedWeight]) -> np.ndarray | QuantizedWeight:
    """A fused tensor from its parts, stacked by rows: quantized parts stay as stored (`cat_rows`), and a part
    the file keeps in floats widens the rest to fp32."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    joined = cat_rows([torch.from_numpy(p) if isinstance(p, np.ndarray) else p for p in parts])
    return joined.numpy() if isinstance(joined, torch.Tensor) else joined


def _check_shapes(tensors: dict[str, np.ndarray | QuantizedWeight], expected: dict[str, tuple[int, ...]],
                  family: GgufFamily) -> None:
    """Every tensor the config needs, at its shape, and no other; a refusal names the HF tensor and, after it,
    the file's."""
    missing = sorted(expected.keys() - tensors.keys())
    extra = sorted(tensors.keys() - expected.keys())
    if missing or extra:
        in_file = [family.gguf_name(name) or "?" for name in missing[:5]]
        raise ModelLoadError(f"tensor set does not match the config: missing {missing[:5]}, "
                             f"unexpected {extra[:5]} (the file's missing: {in_file})")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ModelLoadError(f"tensor {name} has shape {tensors[name].shape}, expected {shape} (the file's "
                                 f"{family.gguf_name(name) or name})")


def _field_value(field: Any) -> Any:
    """A metadata value as plain Python (str, int, float, bool, or a list of those)."""
    import gguf

    kind = field.types[0] if field.types else None
    if kind == gguf.GGUFValueType.ARRAY:
        if len(field.types) > 1 and field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0] if field.data else None
    return bool(value) if kind == gguf.GGUFValueType.BOOL else value


def _dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (so a rename or a write is durable before the next step)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
