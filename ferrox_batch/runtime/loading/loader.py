"""Loading a checkpoint: a Hugging Face-style folder or a `.gguf` file, into a `Decoder` and a `Tokenizer`.

A folder needs `config.json`, `tokenizer.json` and its weights as
`model.safetensors` or shards listed in `model.safetensors.index.json` (each
inside the folder: an index cannot point the loader at another file). A
`.gguf` file is read through the same conversion `fetch` uses, its quantized
weights kept in their blocks or widened as `--weights` says
(`runtime.quant.choice`). Every failure is a `ModelLoadError` that names the file and what is
wrong with it; an unsupported architecture is refused before any weight is
read. What the config claims sizes nothing until the tensors bear it out: its layer count is checked
against the tensors' names (read from the headers) and its vocabulary against the embedding.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ferrox_batch.admission.kv import KvShape
from ferrox_batch.runtime.architectures.decoder import Decoder
from ferrox_batch.runtime.architectures.linear import FP16_KINDS
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.device import (
    DtypeChoice,
    KvDtypeChoice,
    choose_device,
    choose_dtype_reasoned,
    choose_kv_dtype,
)
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.families.registry import wrapped_of
from ferrox_batch.runtime.invariance import batch_invariant_choice, choose_batch_invariance
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.runtime.quant.choice import STORED_QUANT_METHODS, WeightsChoice, choose_weights
from ferrox_batch.runtime.quant.weight import QuantizedWeight, Weight

log = logging.getLogger("ferrox_batch.runtime.loading")


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    decoder: Decoder
    tokenizer: Tokenizer
    source: Path
    #: Why the decoder runs in its dtype (`auto`'s rule, or "asked for").
    dtype_reason: str = "asked for"
    #: The precision as `--dtype` spells it (`fp16w`: fp32 with fp16 linear weights).
    precision: str = "fp32"
    #: Why the KV store holds `decoder.kv_dtype` (`auto`'s rule, or "asked for").
    kv_dtype_reason: str = "asked for"
    #: How the weights are held (`runtime.quant.choice`), and why.
    weights_reason: str = "asked for"
    #: Why the decoder did or did not prefer batch-invariant kernels (`runtime.invariance`).
    batch_invariant_reason: str = "off"

    @property
    def batch_invariant(self) -> bool:
        """Whether each request's logits are the same alone or batched (every linear runs an invariant kernel)."""
        return self.decoder.batch_invariant

    @property
    def weights_summary(self) -> str:
        """The weights' formats and memory, as the start line and `/stats` say them."""
        formats = ", ".join(f"{count} {name}" for name, count in self.decoder.weight_formats.items())
        return f"{self.decoder.weight_bytes / 2**20:.1f} MiB of weights (linear layers: {formats})"

    @property
    def kv_dtype_name(self) -> str:
        """What the KV store holds, as `--kv-cache-dtype` spells it."""
        return KvDtypeChoice(self.decoder.kv_dtype, self.kv_dtype_reason).name

    def kv_shape(self) -> KvShape:
        """KV bytes per position for the dtype the store will hold (the ceiling prices with it)."""
        return PagedKvStore.kv_shape(self.config, self.decoder.kv_dtype)


def load_model(
    path: str | Path,
    *,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = "auto",
    kv_cache_dtype: str | torch.dtype | None = "auto",
    weights: str | None = "auto",
    int8_activations: bool = True,
    batch_invariant: str | bool | None = "auto",
    chat_template: str | None = None,
) -> LoadedModel:
    """`dtype` is the precision (`runtime.device`); `kv_cache_dtype` what the KV store holds (auto, fp32,
    fp16 or bf16: `device.choose_kv_dtype`); `weights` how the weights are held (auto, widen, or a format to
    quantize to: `runtime.quant.choice`); `int8_activations` which kernel multiplies quantized weights
    (`Decoder`'s: int8 activations by default, else the weight-only kernel); `batch_invariant` (auto, on, off,
    narrow or a bool) whether each request's answer must be the same alone or batched (`runtime.invariance`);
    `chat_template` (Jinja text) replaces the checkpoint's chat template (one that does not compile is a
    `ModelLoadError`, raised before the weights are read)."""
    if chat_template is not None:
        Tokenizer.check_chat_template(chat_template)
    model = _load(path, device, dtype, kv_cache_dtype, weights, int8_activations, batch_invariant)
    if chat_template is not None:
        model.tokenizer.set_chat_template(chat_template)
    return model


def _load(path: str | Path, device: str | torch.device | None, dtype: str | torch.dtype | None,
          kv_cache_dtype: str | torch.dtype | None, weights: str | None, int8_activations: bool,
          batch_invariant: str | bool | None) -> LoadedModel:
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"no model at {path}")
    gguf = path.is_file() and path.suffix == ".gguf"
    held = choose_weights(weights, gguf=gguf, device=choose_device(device), int8_activations=int8_activations,
                          stores_quantized=not gguf and _stores_quantized(path))
    batch_invariant = batch_invariant_choice(batch_invariant)  # a bad value fails before the file is read
    if gguf:
        return _load_gguf(path, device, dtype, kv_cache_dtype, held, batch_invariant)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    rename = _renaming(path / "config.json")
    config = ModelConfig.from_file(path / "config.json", checkpoint_layers=_layers_held(path, rename))
    tokenizer = Tokenizer.from_dir(path)
    tensors = _read_safetensors(path, rename)
    return _build(config, tensors, tokenizer, path, device, dtype, kv_cache_dtype, held, batch_invariant)


def _build(
    config: ModelConfig,
    weights: dict[str, Weight],
    tokenizer: Tokenizer,
    source: Path,
    device: str | torch.device | None,
    dtype: str | torch.dtype | None,
    kv_cache_dtype: str | torch.dtype | None,
    held: WeightsChoice,
    batch_invariant: str | bool | None,
) -> LoadedModel:
    embedding = weights.get("model.embed_tokens.weight")
    if embedding is not None and embedding.shape[0] != config.vocab_size:
        # Checked before anything is sized by the config's word (the tokenizer's padding is).
        raise ModelLoadError(f"vocab_size is {config.vocab_size} but model.embed_tokens.weight holds "
                             f"{embedding.shape[0]} rows")
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is {config.vocab_size}"
        )
    tokenizer.pad_to(config.vocab_size)
    chosen_device = choose_device(device)
    chosen = choose_dtype_reasoned(dtype, chosen_device, config)
    in_place = Decoder.kernels_for(chosen_device, chosen.dtype) is not None
    kv = choose_kv_dtype(kv_cache_dtype, chosen, chosen_device, in_place)
    invariance = choose_batch_invariance(batch_invariant, chosen.dtype, chosen_device)
    decoder = Decoder(config, weights, device=chosen_device, dtype=chosen.dtype, weights_format=chosen.weights,
                      kv_dtype=kv.dtype, keep_quantized=held.keep_quantized, quantize_to=held.quantize_to,
                      int8_activations=held.int8_activations, batch_invariant=invariance.prefer,
                      narrow_panels=invariance.narrow_panels)
    if invariance.required and not decoder.batch_invariant:
        linears = decoder.linear_factory.batch_invariant_over(kind for kind in decoder.linear_kinds)
        if not linears:
            raise ModelLoadError(f"--batch-invariant on: not every linear layer runs a batch-invariant kernel here "
                                 f"(linear kernels: {dict(decoder.linear_kinds)}); the invariant ones are ours for "
                                 "bf16 and fp16 weights and the int8 quantized kernel, on the CPU with the C kernels "
                                 "built")
        raise ModelLoadError("--batch-invariant on: this model's mixture-of-experts router (or its shared expert's "
                             "gate) runs torch's float32 matmul, whose rounding may follow the batch's size (only a "
                             "plain softmax top-k router runs in C); serve it with auto or off")
    weights_reason = held.reason
    if held.keep_quantized and "dense" in decoder.weight_formats:
        weights_reason += "; the weights in other formats (or where no quantized kernel runs here) widened"
    kinds = ", ".join(f"{count} {kind}" for kind, count in decoder.linear_kinds.items())
    precision, reason = chosen.name, chosen.reason
    if chosen.weights == "fp16" and not set(FP16_KINDS) & set(decoder.linear_kinds):
        # Every layer fell back (no fp16-weight kernel here): say what runs, not what was asked.
        precision, reason = "fp32", f"{reason}; no fp16-weight linear kernel is available here, so fp32 weights"
        log.warning("%s: fp16 weights were asked for but no fp16-weight linear kernel loaded; running fp32",
                    source.name)
        # `auto`'s K/V follow the precision that runs: plain fp32 keeps fp32 K/V.
        kv = choose_kv_dtype(kv_cache_dtype, DtypeChoice(torch.float32, reason), chosen_device, in_place)
        decoder.kv_dtype = kv.dtype  # no store exists yet
    invariance_reason = invariance.reason
    if invariance.narrow_panels and not (decoder.layer_stack is not None and decoder.layer_stack.narrow_only):
        invariance_reason += "; no second copy is held here: the layer stack does not run these layers"
    loaded = LoadedModel(config, decoder, tokenizer, source, reason, precision, kv.reason, weights_reason,
                         invariance_reason)
    log.info("%s runs in %s on %s (linear kernels: %s): %s; KV cache in %s: %s; %s: %s; batch-invariant: %s (%s)",
             source.name, precision, chosen_device, kinds, reason, kv.name, kv.reason, loaded.weights_summary,
             weights_reason, "yes" if loaded.batch_invariant else "no", invariance_reason)
    return loaded


#: A checkpoint's tensor name as its model reads it (None: not read), for a checkpoint wrapping that model.
Rename = Callable[[str], str | None]


def _renaming(config: Path) -> Rename | None:
    """How the checkpoint's tensor names map to its model's, where it wraps the model in a larger one (a
    multimodal checkpoint's text model: `families.family.Wrapped`); None where the names are the model's."""
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the config's own reading says why
    wrapped = wrapped_of(raw) if isinstance(raw, dict) else None
    return None if wrapped is None else wrapped.name


def _stores_quantized(folder: Path) -> bool:
    """Whether the folder's config says its checkpoint stores weights in a quantized format the runtime serves
    as stored (gpt-oss's published MXFP4 experts); False where it cannot be read (loading says why)."""
    try:
        config = json.loads((folder / "config.json").read_text())
        return config["quantization_config"]["quant_method"] in STORED_QUANT_METHODS
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _layers_held(folder: Path, rename: Rename | None = None) -> int | None:
    """How many layers the folder's tensors hold (one past the highest `model.layers.N`), read from the
    safetensors headers or the shard index alone; None where they cannot be read (loading says why)."""
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text())["weight_map"])
        else:
            with safe_open(str(folder / "model.safetensors"), framework="pt") as file:
                names = list(file.keys())
    except (OSError, SafetensorError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if rename is not None:
        names = [name for name in map(rename, map(str, names)) if name is not None]
    layers = [int(parts[2]) for parts in (str(name).split(".") for name in names)
              if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()]
    return max(layers, default=-1) + 1


def _read_safetensors(folder: Path, rename: Rename | None = None) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as bad:
            raise ModelLoadError(f"{index} is malformed: {bad}") from None
        files = [_shard(folder, index, name) for name in shard_names]
    else:
        files = [folder / "model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"missing weights file {file}")
        try:
            if rename is None:
                weights.update(load_file(str(file)))
                continue
            with safe_open(str(file), framework="pt") as opened:  # only the tensors the model reads
                for name in opened.keys():
                    own = rename(name)
                    if own is not None:
                        weights[own] = opened.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as bad:
            raise ModelLoadError(f"{file} is not a readable safetensors file: {bad}") from None
    return weights


def _shard(folder: Path, index: Path, name: object) -> Path:
    """The file a shard name in `index` stands for, which must lie inside the checkpoint `folder`.

    A checkpoint is often someone else's download: its index must not make the loader open any other file
    (an absolute path, a `..` climbing out, or a link that resolves elsewhere). One layout links out on
    purpose and is allowed: the Hugging Face cache, whose `snapshots/<revision>/` files link into the
    repository's own `blobs/` folder.
    """
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ModelLoadError(f"{index} names shard {name!r} outside the checkpoint folder: a shard must be a "
                             f"relative path inside {folder}")
    path = folder / name
    home = folder.resolve()
    allowed = [home]
    if home.parent.name == "snapshots":  # <repo>/snapshots/<revision>/ -> <repo>/blobs/
        allowed.append(home.parent.parent / "blobs")
    if path.exists() and not any(path.resolve().is_relative_to(root) for root in allowed):
        raise ModelLoadError(f"{index} names shard {name!r}, which resolves to {path.resolve()}, outside the "
                             f"checkpoint folder {folder}")
    return path


def _load_gguf(
    path: Path, device: str | torch.device | None, dtype: str | torch.dtype | None,
    kv_cache_dtype: str | torch.dtype | None, held: WeightsChoice, batch_invariant: str | bool | None,
) -> LoadedModel:
    from ferrox_batch.runtime.loading.gguf_convert import read_gguf

    ckpt = read_gguf(path, keep_quantized=held.keep_quantized)
    config = ModelConfig.from_dict(ckpt.config)
    tokenizer = Tokenizer.from_parts(
        ckpt.tokenizer_json,
        tokenizer_config=ckpt.tokenizer_config,
        generation_config=ckpt.generation_config,
        model_config=ckpt.config,
        source=str(path),
    )
    weights: dict[str, Weight] = {name: value if isinstance(value, QuantizedWeight) else torch.from_numpy(value)
                                  for name, value in ckpt.tensors.items()}
    # The decoder pops each tensor as it converts it: no second reference may keep the file's copy alive
    # (the load's peak is then one copy of the weights, not two).
    ckpt.tensors.clear()
    return _build(config, weights, tokenizer, path, device, dtype, kv_cache_dtype, held, batch_invariant)
