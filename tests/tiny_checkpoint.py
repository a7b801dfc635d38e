"""Tiny random-weight Llama-family checkpoints, written in the Hugging Face folder layout.

Used by the model tests: small enough that a forward is milliseconds, shaped
like the real thing (GQA, tied or separate embeddings, biases for Qwen2, a
sliding window for Mistral, llama3 RoPE scaling), with a real byte-level BPE
tokenizer trained on a few sentences so decode/stop/UTF-8 paths see real
multi-byte tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    """`arch` is a `model_type`: llama, qwen2, mistral, qwen3, smollm3, phi3 or gemma3_text. Gemma 3's norms are
    stored as offsets from one, as its checkpoints store them; Phi-3's projections fused, as its are."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    real_vocab = tok.get_vocab_size()
    head_dim = head_dim or hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    gemma = arch == "gemma3_text"
    one = 0.0 if gemma else 1.0  # where a norm's weights are centred
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab_size, hidden) * 5}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = one + rand(hidden)
        tensors[p + "post_attention_layernorm.weight"] = one + rand(hidden)
        if gemma:
            tensors[p + "pre_feedforward_layernorm.weight"] = rand(hidden)
            tensors[p + "post_feedforward_layernorm.weight"] = rand(hidden)
        tensors[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        if arch in ("qwen3", "gemma3_text"):
            tensors[p + "self_attn.q_norm.weight"] = one + rand(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = one + rand(head_dim)
        if arch == "qwen2":
            tensors[p + "self_attn.q_proj.bias"] = rand(heads * head_dim)
            tensors[p + "self_attn.k_proj.bias"] = rand(kv_heads * head_dim)
            tensors[p + "self_attn.v_proj.bias"] = rand(kv_heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = rand(intermediate, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(intermediate, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, intermediate)
        if arch == "phi3":
            tensors[p + "self_attn.qkv_proj.weight"] = torch.cat([tensors.pop(p + f"self_attn.{n}_proj.weight")
                                                                  for n in "qkv"])
            tensors[p + "mlp.gate_up_proj.weight"] = torch.cat([tensors.pop(p + f"mlp.{n}_proj.weight")
                                                                for n in ("gate", "up")])
    tensors["model.norm.weight"] = one + rand(hidden)
    if not tie:
        tensors["lm_head.weight"] = rand(vocab_size, hidden) * 5
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))

    architectures = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM",
                     "gemma3_text": "Gemma3ForCausalLM"}
    eos_id = tok.token_to_id("<|im_end|>")
    config: dict[str, Any] = {
        "architectures": [architectures[arch]],
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
    if arch == "mistral":
        config["sliding_window"] = sliding_window
    if arch in ("qwen2", "qwen3", "smollm3"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if arch in ("qwen3", "smollm3"):
        config["attention_bias"] = False
    if arch == "smollm3":
        config["no_rope_layers"] = no_rope_layers if no_rope_layers is not None else [1] * layers
        config["pad_token_id"] = tok.token_to_id("<|endoftext|>")  # its default names an id past this vocabulary
    if arch == "phi3":
        config["pad_token_id"] = tok.token_to_id("<|endoftext|>")
        config["sliding_window"] = sliding_window
        if partial_rotary_factor is not None:
            config["partial_rotary_factor"] = partial_rotary_factor
        if rope_scaling is not None and rope_scaling.get("rope_type") == "longrope":
            config["original_max_position_embeddings"] = rope_scaling["original_max_position_embeddings"]
    if gemma:
        config.pop("hidden_act")
        config.update({
            "hidden_activation": "gelu_pytorch_tanh",
            "pad_token_id": tok.token_to_id("<|endoftext|>"),
            "sliding_window": sliding_window or 8,
            "layer_types": layer_types or ["sliding_attention"] * (layers - 1) + ["full_attention"],
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "query_pre_attn_scalar": query_pre_attn_scalar or head_dim,
            "rms_norm_eps": 1e-6,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        })
    config.update(extra_config or {})
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
