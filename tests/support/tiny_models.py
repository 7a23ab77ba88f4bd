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


def _perturb_norms(model, sigma: float = 0.3) -> None:
    """Norm weights start at one; spread them so that a norm applied wrongly (or not) shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, sigma)


def save_tiny_qwen3(path: Path, **overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    config = Qwen3Config(**_common(tie_word_embeddings=False, head_dim=16, **overrides))
    model = Qwen3ForCausalLM(config).eval()
    _perturb_norms(model)  # QK-norm among them
    model.save_pretrained(path)
    return model


# Shorter than the tests' prompts and not a multiple of their block sizes: windows end mid-block.
TINY_WINDOW = 12


def save_tiny_mistral(path: Path, **overrides):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    config = MistralConfig(**_common(tie_word_embeddings=False, sliding_window=TINY_WINDOW, **overrides))
    model = MistralForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def save_tiny_qwen3_moe(path: Path, **overrides):
    """4 experts, 2 per token, routing weights renormalised; the MLP width splits over 2 ranks."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(4)
    config = Qwen3MoeConfig(**_common(tie_word_embeddings=False, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True, **overrides))
    model = Qwen3MoeForCausalLM(config).eval()
    _perturb_norms(model)
    model.save_pretrained(path)
    return model


def save_tiny_mixtral(path: Path, **overrides):
    """Mistral's window over 4 experts, 2 per token."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(5)
    config = MixtralConfig(**_common(tie_word_embeddings=False, sliding_window=TINY_WINDOW, num_local_experts=4,
                                     num_experts_per_tok=2, **overrides))
    model = MixtralForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def save_tiny_gemma3(path: Path, **overrides):
    """Local layers (window 12) around a global one, each with its own RoPE base; 16-wide heads."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(6)
    config = Gemma3TextConfig(**_common(num_hidden_layers=3, head_dim=16, sliding_window=TINY_WINDOW,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        query_pre_attn_scalar=16, **overrides))
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        # Scaled by sqrt(hidden) on lookup, the wide init would swamp every layer (one token
        # repeated); and Gemma's norm weights are offsets from one that start at zero.
        model.model.embed_tokens.weight /= config.hidden_size ** 0.5
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return model


TINY_FAMILIES = {"qwen3": save_tiny_qwen3, "mistral": save_tiny_mistral, "qwen3_moe": save_tiny_qwen3_moe,
                 "mixtral": save_tiny_mixtral, "gemma3": save_tiny_gemma3}


# --- weight transplants: a real model's weights in another family's layout -----------------------

def transplant(source: Path, target: Path, architecture: str, model_type: str, experts: int = 0,
               **config_changes) -> Path:
    """`source` (a Llama checkpoint, e.g. SmolLM2) re-declared as `architecture`: its config's
    fields kept, the family's own added; zero q/k/v biases (Qwen2), QK-norm weights of one
    (Qwen3), and `experts` copies of each layer's MLP behind a random router (Mixtral)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name not in ("config.json", "model.safetensors") and item.is_file() and not item.name.startswith("."):
            shutil.copy(item, target / item.name)
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=[architecture], model_type=model_type, **config_changes)
    tensors = load_file(str(source / "model.safetensors"))
    generator = torch.Generator().manual_seed(6)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        if model_type == "qwen2":
            for proj in "qkv":
                rows = tensors[f"{layer}self_attn.{proj}_proj.weight"].shape[0]
                tensors[f"{layer}self_attn.{proj}_proj.bias"] = torch.zeros(rows)
        if model_type in ("qwen3", "qwen3_moe"):
            for norm in ("q_norm", "k_norm"):
                tensors[f"{layer}self_attn.{norm}.weight"] = torch.ones(config["head_dim"])
        if experts:  # Mixtral's own names: w1 gate, w3 up, w2 down
            mlp = {p: tensors.pop(f"{layer}mlp.{p}_proj.weight") for p in ("gate", "up", "down")}
            for e in range(experts):
                for part, source_part in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                    tensors[f"{layer}block_sparse_moe.experts.{e}.{part}.weight"] = mlp[source_part].clone()
            tensors[f"{layer}block_sparse_moe.gate.weight"] = torch.randn(experts, config["hidden_size"],
                                                                          generator=generator)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    return target
