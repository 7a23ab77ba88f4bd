"""Which tensor of a GGUF file holds each weight the decoder takes, and what llama.cpp's converter
changed in its values.

The names come from the family's plan (services/common/families/plan.py, WeightNames: the Hugging
Face names) and are mapped to llama.cpp's through the gguf package's own TensorNameMap for the
file's architecture: a Llama layer's `post_attention_layernorm` is `ffn_norm` there, while Gemma
3's is `post_attention_norm` and its `ffn_norm` is `pre_feedforward_layernorm`."""

from __future__ import annotations

from vmesh.services.common.model_loading import ModelLoadError
from vmesh.services.common.model_spec import ModelSpec

# llama.cpp's converter stores these architectures' RMSNorm weights as 1 + w (their norms scale
# by 1 + w); transformers subtracts the one again on load (its Gemma2TensorProcessor), and so
# does read_gguf_weights, so that the plan's norm_weight_offset applies to both paths alike.
NORMS_STORED_PLUS_ONE = ("gemma", "gemma2", "gemma3")


def plan_weight_names(spec: ModelSpec) -> list[str]:
    """Every tensor name the decoder may take for this plan (biases included: absent ones are skipped)."""
    names = spec.model_plan.names
    wanted = [names.embed, names.final_norm, names.lm_head]
    for i, layer in enumerate(spec.layers):
        prefix = names.layer.format(i)
        local = [names.input_norm, names.post_attention_norm]
        if layer.norms == "sandwich":
            local += [names.pre_mlp_norm, names.post_mlp_norm]
        if layer.attention.qk_norm:
            local += [names.q_norm, names.k_norm]
        for part in "qkvo":
            local += [f"{names.attention.format(part)}.weight", f"{names.attention.format(part)}.bias"]
        if layer.mlp.is_moe:
            local.append(names.router)
        else:
            local += [f"{names.mlp.format(part)}.weight" for part in ("gate", "up", "down")]
        wanted += [prefix + name for name in local]
    return wanted


def gguf_to_hf_names(architecture: str, spec: ModelSpec) -> dict[str, str]:
    """{GGUF tensor name: Hugging Face name} for the weights of `spec`'s plan."""
    import gguf

    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ModelLoadError(f"GGUF architecture {architecture!r} (general.architecture) is unknown to the "
                             "gguf package")
    tensor_map = gguf.get_tensor_name_map(arch, spec.num_layers)
    mapping = {}
    for name in plan_weight_names(spec):
        gguf_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            mapping[gguf_name] = name
    return mapping
