"""Tiny random-weight checkpoints of any family the runtime runs, written in the Hugging Face folder layout.

Used by the model tests: small enough that a forward is milliseconds, shaped
like the real thing (GQA, tied or separate embeddings, biases for Qwen2, a
sliding window for Mistral, llama3 RoPE scaling), with a real byte-level BPE
tokenizer trained on a few sentences so decode/stop/UTF-8 paths see real
multi-byte tokens. The tensors are what the family's own module reads (the
package's registry); the config fields each family's tests set are its entry
in `tiny_families`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tiny_families import CONFIGS, DROP, FixtureArgs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.families.family import EMBEDDING, FINAL_NORM, LM_HEAD
from ferrox_batch.runtime.families.registry import family_of_model_type

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: ChatML that renders tools the Hermes/Qwen way: definitions in <tools>, calls as <tool_call> blocks,
#: results as <tool_response> (a tiny stand-in for a tool-calling checkpoint's template).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined %}<|im_start|>assistant\n"
    "{% for call in message['tool_calls'] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching keeps every request moving.",
    "Paged attention stores keys and values in blocks.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve r\u00e9sum\u00e9, \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8, emoji \U0001f680\U0001f525.",
    "def forward(self, x): return self.layers(x) + 1",
] * 4


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


#: The order the fixtures have always drawn a layer's weights in (then anything not named here, in the
#: family's own order): the embedding, each layer's, the final norm, the output head.
_DRAW_ORDER = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm", "self_attn.q_proj.weight", "self_attn.qkv_proj.weight",
               "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj", "self_attn.q_norm",
               "self_attn.k_norm", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
               "mlp.gate_proj", "mlp.gate_up_proj", "mlp.up_proj", "mlp.down_proj")


def _draw_key(item: tuple[str, tuple[int, ...]]) -> tuple[int, int, int]:
    name = item[0]
    if name == EMBEDDING:
        return (0, 0, 0)
    if not name.startswith("model.layers."):
        return (2, int(name == LM_HEAD), 0)
    layer, rest = name[len("model.layers."):].split(".", 1)
    rank = next((i for i, part in enumerate(_DRAW_ORDER) if rest.startswith(part)), len(_DRAW_ORDER))
    return (1, int(layer), rank)


def write_tiny_checkpoint(
    folder: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 384,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tie: bool = True,
    sliding_window: int | None = None,
    rope_scaling: dict[str, Any] | None = None,
    max_positions: int = 512,
    std: float = 0.08,
    chat_template: str | None = None,
    head_dim: int | None = None,
    no_rope_layers: list[int] | None = None,
    partial_rotary_factor: float | None = None,
    layer_types: list[str] | None = None,
    query_pre_attn_scalar: float | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """`arch` is a `model_type` the runtime's family registry knows; its tensors (names, shapes, which are
    norms, what its norms are offsets from) are that family's, and its config fields beyond the shared ones its
    entry in `tiny_families.CONFIGS`. Weights are drawn in `_DRAW_ORDER`, so every seed keeps its weights."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    real_vocab = tok.get_vocab_size()
    head_dim = head_dim or hidden // heads
    family = family_of_model_type(arch)
    eos_id = tok.token_to_id("<|im_end|>")
    config: dict[str, Any] = {
        "architectures": [family.architectures[0]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": tie,
        "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    args = FixtureArgs(layers, head_dim, sliding_window, rope_scaling, no_rope_layers, partial_rotary_factor,
                       layer_types, query_pre_attn_scalar, tok.token_to_id("<|endoftext|>"))
    for key, value in CONFIGS[arch](args).items():
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    config.update(extra_config or {})

    shape = ModelConfig.from_dict(config)
    specs = family.layers(shape)
    norms = {name for spec in specs for name in spec.norm_names()} | {FINAL_NORM}
    centre = 1.0 - family.norm_offset  # where a norm's weights are centred
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, size in sorted(family.tensors(shape).items(), key=_draw_key):
        value = torch.randn(*size, generator=gen) * std
        if name in (EMBEDDING, LM_HEAD):
            value = value * 5
        elif name in norms and centre:
            value = centre + value
        tensors[name] = value
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": chat_template or CHATML_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_positions,
    }, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [eos_id, tok.token_to_id("<|endoftext|>")],
    }))
    assert real_vocab <= vocab_size
    return folder
