"""The model families vmesh runs: one module each, mapping a transformers config to a layer plan
(plan.py). Adding a family is one module here, listed in FAMILIES, plus its tests."""

from __future__ import annotations

from typing import Any

from vmesh.services.common.families import gemma3, llama, mistral, qwen2, qwen3, qwen3_moe
from vmesh.services.common.families.plan import Family, UnsupportedModelError

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY, mistral.MIXTRAL,
                                qwen3_moe.FAMILY, gemma3.FAMILY)
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES)
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}


def family_of(config: Any) -> Family:
    """The family of a config: by its architectures list, else by its model_type (GGUF metadata)."""
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        name = architectures[0]
        if name not in _BY_ARCHITECTURE:
            raise UnsupportedModelError(
                f"architecture {name!r} (config field architectures) is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        return _BY_ARCHITECTURE[name]
    model_type = getattr(config, "model_type", None)
    if model_type not in _BY_MODEL_TYPE:
        raise UnsupportedModelError(
            f"model type {model_type!r} (config field model_type) is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return _BY_MODEL_TYPE[model_type]
