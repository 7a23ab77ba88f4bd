"""The shape of a supported decoder, read once from a Hugging Face config: the sizes every layer
shares, and the family's layer plan (services/common/families/) for what each layer computes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vmesh.services.common.families import SUPPORTED_ARCHITECTURES, family_of
from vmesh.services.common.families.plan import (
    SUPPORTED_ROPE_TYPES,
    AttentionPlan,
    LayerPlan,
    MlpPlan,
    ModelPlan,
    UnsupportedModelError,
    head_dim,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelSpec", "UnsupportedModelError", "architecture_of"]


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # None: every layer the Llama layer the fields above describe (specs built by hand in tests).
    plan: ModelPlan | None = None

    def __post_init__(self) -> None:
        if self.plan is None:
            layer = LayerPlan(AttentionPlan(self.rope_theta, self.rope_scaling, qkv_bias=self.qkv_bias),
                              MlpPlan(self.intermediate_size))
            object.__setattr__(self, "plan", ModelPlan((layer,) * self.num_layers))
        if len(self.layers) != self.num_layers:
            raise UnsupportedModelError(f"the layer plan has {len(self.layers)} layers for {self.num_layers}")

    @property
    def layers(self) -> tuple[LayerPlan, ...]:
        assert self.plan is not None, "set in __post_init__"
        return self.plan.layers

    @property
    def model_plan(self) -> ModelPlan:
        assert self.plan is not None, "set in __post_init__"
        return self.plan

    def with_layers(self, layers: tuple[LayerPlan, ...], **changes: Any) -> ModelSpec:
        """This spec with another layer plan (a tensor-parallel rank's narrower MLPs)."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.model_plan, layers=layers), **changes)

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        family = family_of(config)
        plan = family.plan(config)
        first = plan.layers[0].attention
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        num_heads = config.num_attention_heads
        return cls(
            architecture=family.architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim(config),
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=first.rope_theta,
            rope_scaling=dict(first.rope_scaling) if first.rope_scaling else None,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=first.qkv_bias,
            eos_token_ids=eos_ids,
            bos_token_id=getattr(config, "bos_token_id", None),
            plan=plan,
        )


def architecture_of(config: Any) -> str:
    return family_of(config).architecture
