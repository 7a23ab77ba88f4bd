"""Qwen2: Llama's layer with biases on q, k and v; sliding-window layers where the config asks."""

from __future__ import annotations

from typing import Any

from vmesh.services.common.families.plan import Family, ModelPlan, dense_layers


def plan(config: Any) -> ModelPlan:
    return ModelPlan(dense_layers(config, qkv_bias=True))


FAMILY = Family("Qwen2ForCausalLM", "qwen2", plan)
