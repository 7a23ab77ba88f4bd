"""Llama (and SmolLM2, which is one): pre-norms, SwiGLU, RoPE with linear or llama3 scaling."""

from __future__ import annotations

from typing import Any

from vmesh.services.common.families.plan import Family, ModelPlan, dense_layers, refuse_set


def plan(config: Any) -> ModelPlan:
    refuse_set(config, "mlp_bias")
    return ModelPlan(dense_layers(config, qkv_bias=bool(getattr(config, "attention_bias", False))))


FAMILY = Family("LlamaForCausalLM", "llama", plan)
