"""Tiny randomly initialised checkpoints, saved the way users' checkpoints are."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 300


def _common(**overrides):
    # A wide init keeps greedy outputs varied instead of one repeated token.
    base = dict(vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    base.update(overrides)
    return base


def save_tiny_llama(path: Path, max_shard_size: str | None = None, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**_common(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=500000.0, **overrides))
    model = LlamaForCausalLM(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def save_tiny_qwen2(path: Path, **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(**_common(tie_word_embeddings=False, use_sliding_window=False, **overrides))
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return model
