"""Turn a llama.cpp GGUF file into the pieces of a Hugging Face checkpoint folder.

The default model reaches us only as a quantized GGUF, while the runtime (and
transformers, which the tests compare against) read HF folders. This module is
the one place that knows the GGUF layout: it dequantizes every tensor to fp32,
renames it to the HF name, undoes llama.cpp's Q/K row permutation, rebuilds the
byte-level BPE tokenizer from the vocabulary in the metadata, and derives
`config.json`, `tokenizer_config.json` and `generation_config.json`.

Promises: `read_gguf` returns fp32 arrays under HF names with HF shapes, or
raises `ModelLoadError` (`UnsupportedArchitecture` for a non-llama file) with a
message naming the file and the problem. It never touches the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ferrox_batch.runtime.errors import ModelLoadError, UnsupportedArchitecture
from ferrox_batch.runtime.loading.gguf_tokenizer import eog_ids, tokenizer_from_metadata

SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = ("llama",)

# (done, total, tensor or file name): called after each slow step.
Progress = Callable[[int, int, str], None]

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}


@dataclass(slots=True)
class ConvertedCheckpoint:
    """Everything an HF folder holds, in memory; `tensors` are fp32 under HF names."""

    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


def read_gguf(path: str | Path, *, progress: Progress | None = None) -> ConvertedCheckpoint:
    """Convert the GGUF at `path`; `progress` is told about each dequantized tensor."""
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
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(str(arch), list(SUPPORTED_GGUF_ARCHITECTURES))
    try:
        config = _config(meta, {t.name for t in reader.tensors})
        tensors = _tensors(reader, config, progress)
        tokenizer_json, tokenizer_config = tokenizer_from_metadata(meta, config)
    except ModelLoadError as err:
        raise ModelLoadError(f"{path}: {err}") from None
    except (KeyError, ValueError, TypeError, NotImplementedError) as err:
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


def _config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{name}", default)
        if value is None:
            raise ModelLoadError(f"metadata key llama.{name} is missing")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ModelLoadError(f"partial rotary embeddings ({rotary} of {head_dim}) are not supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"rope scaling ({scaling}, rope_freqs) is not supported by the converter")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        # llama.cpp writes no output.weight when the head reuses the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    for field in ("bos", "eos", "padding"):
        value = meta.get(f"tokenizer.ggml.{field}_token_id")
        if value is not None:
            config["pad_token_id" if field == "padding" else f"{field}_token_id"] = int(value)
    config.setdefault("bos_token_id", None)
    return config


def _tensors(reader: Any, config: dict[str, Any], progress: Progress | None) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for done, t in enumerate(reader.tensors, 1):
        name = _hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        weight = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.endswith("attn_q.weight"):
            weight = unpermute_rope_rows(weight, heads)
        elif t.name.endswith("attn_k.weight"):
            weight = unpermute_rope_rows(weight, kv_heads)
        out[name] = weight
        if progress:
            progress(done, len(reader.tensors), name)
    _check_shapes(out, config)
    return out


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS and parts[1] == "weight":
        return f"{_GLOBAL_TENSORS[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS and parts[3] == "weight":
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.weight"
    raise ModelLoadError(f"unexpected tensor {gguf_name!r} for a llama model")


def _check_shapes(tensors: dict[str, np.ndarray], c: dict[str, Any]) -> None:
    h, v, ff = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    expected = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        expected["lm_head.weight"] = (v, h)
    per_layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (ff, h), "mlp.up_proj": (ff, h),
                 "mlp.down_proj": (h, ff), "input_layernorm": (h,), "post_attention_layernorm": (h,)}
    for i in range(c["num_hidden_layers"]):
        expected.update({f"model.layers.{i}.{k}.weight": s for k, s in per_layer.items()})
    missing = sorted(expected.keys() - tensors.keys())
    extra = sorted(tensors.keys() - expected.keys())
    if missing or extra:
        raise ModelLoadError(f"tensor set does not match the config: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ModelLoadError(f"tensor {name} has shape {tensors[name].shape}, expected {shape}")


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


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (so a rename or a write is durable before the next step)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
