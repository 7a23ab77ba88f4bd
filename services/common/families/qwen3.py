"""Qwen3: Llama's layer with RMSNorm over each query and key head (QK-norm), no biases."""

from __future__ import annotations

from typing import Any

from vmesh.services.common.families.plan import Family, ModelPlan, dense_layers


def plan(config: Any) -> ModelPlan:
    return ModelPlan(dense_layers(config, qk_norm=True, qkv_bias=bool(getattr(config, "attention_bias", False))))


FAMILY = Family("Qwen3ForCausalLM", "qwen3", plan)
