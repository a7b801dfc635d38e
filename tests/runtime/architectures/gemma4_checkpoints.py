"""Tiny Gemma 4 (text) checkpoints written by transformers' own `Gemma4ForCausalLM`, for the Gemma 4 tests.

Each variant sets what differs from the defaults: local and global layers mixed, the global layers' heads of
their own size and count, K=V on the global layers, the last layers sharing earlier layers' K/V with a
double-wide MLP, per-layer inputs, soft-capped logits, RoPE bases that are not 10,000. The weights are
redrawn wider than transformers' initialisation (which leaves every logit near zero), so greedy steps are
decided by the arithmetic.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from tiny_checkpoint import CHATML_TEMPLATE, build_tokenizer

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 200_000.0}}

#: name -> the config fields beside the shared ones.
VARIANTS: dict[str, dict[str, Any]] = {
    # Everything at once: K=V, two layers sharing K/V (one of each kind) with double-wide MLPs, per-layer inputs.
    # Global heads of 48 (one KV head) beside local ones of 16 (two): blocks of the two kinds' lcm.
    "gemma4": dict(global_head_dim=48, attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2,
                   use_double_wide_mlp=True, hidden_size_per_layer_input=8, final_logit_softcapping=30.0),
    # The mixture of experts beside every layer's MLP, with the rest of the first variant.
    "gemma4-moe": dict(global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1,
                       num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                       final_logit_softcapping=30.0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                       moe_intermediate_size=32),
    # Separate K and V on every layer, no sharing, no per-layer inputs, no softcapping.
    "gemma4-plain": dict(global_head_dim=32, attention_k_eq_v=False, num_kv_shared_layers=0,
                         hidden_size_per_layer_input=0, final_logit_softcapping=None),
}


def tiny_gemma4(folder: Path, variant: str, *, seed: int = 0, multimodal: bool = False) -> Path:
    """Write the tiny checkpoint `variant` (a key of `VARIANTS`) and a tokenizer into `folder`; `multimodal`:
    as the text model of a `Gemma4ForConditionalGeneration` (with no vision or audio tower)."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(320)
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    config = Gemma4TextConfig(
        vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64, intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=list(LAYER_TYPES), sliding_window=8, rope_parameters=json.loads(json.dumps(ROPE)),
        max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=eos,
        **VARIANTS[variant])
    torch.manual_seed(seed)
    if multimodal:
        model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=config, vision_config=None,
                                                            audio_config=None)).eval()
    else:
        model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                std = 0.5 if "embed_tokens" in name else 1.2 / math.sqrt(param.shape[-1])
                param.normal_(0.0, std)
            else:  # norms' weights, layer scalars: near one
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.8 + 0.4 * torch.rand_like(buffer))
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
    }))
    return folder
