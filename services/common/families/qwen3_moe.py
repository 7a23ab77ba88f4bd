"""Qwen3-MoE: Qwen3's attention (QK-norm) over a top-k mixture of SwiGLU experts. Layers listed in
mlp_only_layers, or off the decoder_sparse_step stride, keep a dense MLP, as in transformers."""

from __future__ import annotations

from typing import Any

from vmesh.services.common.families.plan import Family, MlpPlan, ModelPlan, activation, dense_layers


def plan(config: Any) -> ModelPlan:
    act = activation(config)
    dense = MlpPlan(config.intermediate_size, act)
    experts = MlpPlan(config.moe_intermediate_size, act, num_experts=config.num_experts,
                      experts_per_token=config.num_experts_per_tok, normalize_routing=bool(config.norm_topk_prob))
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1

    def mlp(layer: int) -> MlpPlan:
        return experts if layer not in dense_only and (layer + 1) % step == 0 else dense

    return ModelPlan(dense_layers(config, qk_norm=True, qkv_bias=bool(getattr(config, "attention_bias", False)),
                                  mlp=mlp))


FAMILY = Family("Qwen3MoeForCausalLM", "qwen3_moe", plan)
