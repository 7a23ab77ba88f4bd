"""Mistral: Llama's layer with every layer's attention restricted to `sliding_window` positions
(when the config sets one), and Mixtral: the same attention over a top-k mixture of SwiGLU experts,
its routing weights the softmax over the chosen experts (normalised)."""

from __future__ import annotations

from typing import Any

from vmesh.services.common.families.plan import Family, MlpPlan, ModelPlan, WeightNames, activation, dense_layers

# Mixtral's checkpoints keep their original module names: w1 (gate), w3 (up), w2 (down).
MIXTRAL_NAMES = WeightNames(router="block_sparse_moe.gate.weight", expert="block_sparse_moe.experts.{}.{}.weight",
                            expert_parts=("w1", "w3", "w2"), experts_gate_up="block_sparse_moe.experts.gate_up_proj",
                            experts_down="block_sparse_moe.experts.down_proj")


def plan(config: Any) -> ModelPlan:
    return ModelPlan(dense_layers(config))


def mixtral_plan(config: Any) -> ModelPlan:
    experts = MlpPlan(config.intermediate_size, activation(config), num_experts=config.num_local_experts,
                      experts_per_token=config.num_experts_per_tok, normalize_routing=True)
    return ModelPlan(dense_layers(config, mlp=lambda _layer: experts), names=MIXTRAL_NAMES)


FAMILY = Family("MistralForCausalLM", "mistral", plan)
MIXTRAL = Family("MixtralForCausalLM", "mixtral", mixtral_plan)
