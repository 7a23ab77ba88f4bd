"""Layer plans: what a decoder layer computes, declared per layer, free of torch.

A model family (one module beside this one) maps a transformers config to a `ModelPlan`: per
layer the attention kind (global or a sliding window of its size, QK-norm, biases, RoPE base and
scaling, score scale), the norm placement and the MLP kind (dense SwiGLU/GeGLU or a mixture of
experts), plus the model-wide embedding scale and the checkpoint's tensor names. The worker's
decoder (services/worker/model.py) executes any plan; it knows no family by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class UnsupportedModelError(ValueError):
    """A config vmesh cannot run; the message names the config field at fault."""


# The MLP activations: SwiGLU ("silu") and GeGLU with tanh-approximated GELU ("gelu_tanh").
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class AttentionPlan:
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None  # None: plain RoPE; else with its rope_type
    # Sliding window: a query sees this many positions, its own included (transformers'
    # `kv_idx > q_idx - sliding_window`); None: every earlier position (global attention).
    window: int | None = None
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    qkv_bias: bool = False
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5

    @property
    def rope_key(self) -> tuple[float, str]:
        """Layers with equal keys share one table of cos/sin rows."""
        return self.rope_theta, repr(sorted((self.rope_scaling or {}).items()))


@dataclass(frozen=True)
class MlpPlan:
    intermediate_size: int  # per expert for a mixture of experts
    activation: str = "silu"  # a value of ACTIVATIONS
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    normalize_routing: bool = True  # top-k routing weights renormalised to sum to one

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True)
class LayerPlan:
    attention: AttentionPlan
    mlp: MlpPlan
    # "pre": a norm before attention and one before the MLP (Llama). "sandwich": also a norm on
    # each branch's output before it joins the residual stream (Gemma 2/3).
    norms: str = "pre"


@dataclass(frozen=True)
class WeightNames:
    """The checkpoint's tensor names (transformers' own): model-wide ones whole, layer ones
    relative to `layer` (formatted with the layer index). One default serves the Llama lineage."""

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    layer: str = "model.layers.{}."
    input_norm: str = "input_layernorm.weight"
    post_attention_norm: str = "post_attention_layernorm.weight"
    pre_mlp_norm: str = "pre_feedforward_layernorm.weight"  # sandwich norms only
    post_mlp_norm: str = "post_feedforward_layernorm.weight"  # sandwich norms only
    attention: str = "self_attn.{}_proj"  # q, k, v, o
    q_norm: str = "self_attn.q_norm.weight"
    k_norm: str = "self_attn.k_norm.weight"
    mlp: str = "mlp.{}_proj"  # gate, up, down
    router: str = "mlp.gate.weight"
    # Experts stacked, as transformers >= 5 holds them: gate_up [E, 2 * inter, hidden] and down
    # [E, hidden, inter]; or one module per expert, as checkpoints on the hub name them.
    experts_gate_up: str = "mlp.experts.gate_up_proj"
    experts_down: str = "mlp.experts.down_proj"
    expert: str = "mlp.experts.{}.{}.weight"  # expert index, then one of expert_parts
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelPlan:
    layers: tuple[LayerPlan, ...]
    embedding_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + weight) (Gemma: 1)
    names: WeightNames = field(default_factory=WeightNames)


@dataclass(frozen=True)
class Family:
    """One architecture: its names in configs and how its config becomes a plan."""

    architecture: str  # config.architectures[0]
    model_type: str  # config.model_type
    plan: Callable[[Any], ModelPlan]
    # The family's turn format as a Jinja chat template, for checkpoints that carry none (a GGUF
    # file without tokenizer.chat_template), as llama.cpp keeps one per known architecture.
    chat_template: str | None = None
    # The token that closes a turn in that format: generation stops there too (config eos aside).
    end_of_turn: str | None = None


# --- config readers the families share ---------------------------------------------------------

def rope_parameters(config: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) of a config, or of one layer type where transformers keys them
    by layer type (Gemma 3). Refuses a scaling vmesh does not implement."""
    params = getattr(config, "rope_parameters", None)  # transformers >= 5 folds theta and scaling in here
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} (config field rope_parameters.rope_type) is not supported "
            f"(supported: {SUPPORTED_ROPE_TYPES})")
    theta = float(params.get("rope_theta", 10000.0))
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}


def activation(config: Any, field_name: str = "hidden_act") -> str:
    name = getattr(config, field_name, None) or "silu"
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"MLP activation {name!r} (config field {field_name}) is not supported (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window: from `layer_types` where the config has them (transformers
    >= 5 derives them for Qwen2/Qwen3 from use_sliding_window and max_window_layers), else the
    one `sliding_window` of every layer (Mistral), unless use_sliding_window says no."""
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None and hasattr(config, "max_window_layers"):  # a raw Qwen2 config.json
        layer_types = ["sliding_attention" if i >= config.max_window_layers else "full_attention"
                       for i in range(layers)]
    if layer_types is None:
        return [window] * layers
    if len(layer_types) != layers:
        raise UnsupportedModelError(f"config field layer_types has {len(layer_types)} entries for {layers} layers")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} (config field layer_types) are not supported "
                                    "(supported: full_attention, sliding_attention)")
    if "sliding_attention" in layer_types and not window:
        raise UnsupportedModelError("config field layer_types has sliding_attention layers but sliding_window is unset")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def refuse_set(config: Any, *fields: str) -> None:
    """Refuse a config that sets any of these fields (features vmesh does not implement)."""
    for name in fields:
        if getattr(config, name, None):
            raise UnsupportedModelError(f"config field {name} = {getattr(config, name)!r} is not supported")


def dense_layers(config: Any, *, qk_norm: bool = False, qkv_bias: bool = False,
                 mlp: Callable[[int], MlpPlan] | None = None) -> tuple[LayerPlan, ...]:
    """The Llama-lineage layer: pre-norms, RoPE from the config, each layer's window from
    `layer_windows`, and a dense SwiGLU MLP unless `mlp` says otherwise for a layer."""
    theta, scaling = rope_parameters(config)
    act = activation(config)
    dense = MlpPlan(config.intermediate_size, act)
    return tuple(LayerPlan(AttentionPlan(theta, scaling, window, qk_norm, qkv_bias), mlp(i) if mlp else dense)
                 for i, window in enumerate(layer_windows(config)))
