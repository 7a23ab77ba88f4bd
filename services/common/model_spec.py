"""The shape of a supported decoder, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
MODEL_TYPE_TO_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    pass


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

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        architecture = architecture_of(config)
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModelError("sliding-window attention is not supported")
        rope = _rope_parameters(config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(config, "bos_token_id", None),
        )


def architecture_of(config: Any) -> str:
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        name = architectures[0]
    else:
        name = MODEL_TYPE_TO_ARCHITECTURE.get(getattr(config, "model_type", ""), "")
        if not name:
            raise UnsupportedModelError(
                f"model type {getattr(config, 'model_type', None)!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {name!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return name


def _rope_parameters(config: Any) -> dict[str, Any]:
    # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return scaling
