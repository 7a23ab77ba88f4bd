"""LoRA adapters in PEFT's format, read from disk into the layout the worker's fused linears use.

A PEFT adapter directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, the
target modules) and `adapter_model.safetensors` (per targeted module, `lora_A` [r, in] and
`lora_B` [out, r]). PEFT computes `base(x) + lora_B(lora_A(x)) * scaling`, scaling being
`lora_alpha / r` (or `/ sqrt(r)` with rsLoRA); the scaling is folded into B here, once.

The worker fuses q/k/v into one linear and gate/up into another (services/worker/model.py), so
an adapter's pieces are laid out per fused linear: its A's side by side, each in a band of
`max_rank` columns, and its B's block-diagonally, each segment writing only its own output
rows. A module the adapter does not target keeps zeros. Under tensor parallelism a rank takes
the B rows of its column-parallel outputs and the A columns of its row-parallel inputs, with
the same slicing as the base weights (services/worker/tensor_parallel.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from vmesh.services.common.model_spec import ModelSpec
from vmesh.services.worker.tensor_parallel import shard_weights

# The worker's fused linears and the Hugging Face projections each is made of, in output order.
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
SUPPORTED_MODULES = tuple(module for modules in FUSED_TARGETS.values() for module in modules)
_PARENT_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraLoadError(ValueError):
    """An adapter that cannot be served: missing files, a format or module vmesh does not take,
    a rank over --max-lora-rank, shapes that do not fit the model."""


@dataclass
class LoraAdapter:
    """One adapter as the worker holds it in host memory: per (layer, fused linear), A laid out
    [in, bands * max_rank] and B (scaled) [bands * max_rank, out], ready to copy into a slot."""

    name: str
    path: str
    rank: int
    fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_peft_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoraLoadError(f"no adapter_config.json in {path}")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"{path}: peft_type {config.get('peft_type')!r}, not LORA")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise LoraLoadError(f"{path}: {flag} adapters are not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise LoraLoadError(f"{path}: adapters with biases or modules_to_save are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraLoadError(f"{path}: per-module ranks (rank_pattern, alpha_pattern) are not supported")
    return config


def read_peft_tensors(path: Path) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(layer, module): {"A": [r, in], "B": [out, r]}} from adapter_model.safetensors."""
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoraLoadError(f"no adapter_model.safetensors in {path}")
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(weights_file)).items():
        match = _TENSOR_NAME.search(name)
        if match is None or match.group(2) not in SUPPORTED_MODULES:
            raise LoraLoadError(f"{path}: tensor {name} is not a LoRA weight of {', '.join(SUPPORTED_MODULES)}")
        pieces.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    return pieces


def load_peft_adapter(name: str, path: str, spec: ModelSpec, max_rank: int, dtype: torch.dtype,
                      tp_rank: int = 0, tp_size: int = 1) -> LoraAdapter:
    """The adapter at `path` for `spec` (the whole model's, before any tensor-parallel split), as
    tensor-parallel rank `tp_rank` of `tp_size` holds it."""
    directory = Path(path)
    config = read_peft_config(directory)
    rank = int(config["r"])
    if not 0 < rank <= max_rank:
        raise LoraLoadError(f"adapter {name!r} has rank {rank}; this worker takes ranks up to --max-lora-rank "
                            f"{max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pieces = read_peft_tensors(directory)
    if tp_size > 1:
        pieces = _shard(pieces, spec, tp_rank, tp_size)
    fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    layers = sorted({layer for layer, _ in pieces})
    if layers and layers[-1] >= spec.num_layers:
        raise LoraLoadError(f"adapter {name!r} targets layer {layers[-1]}; the model has {spec.num_layers}")
    for layer in layers:
        for linear, modules in FUSED_TARGETS.items():
            present = [pieces.get((layer, module)) for module in modules]
            if not any(present):
                continue
            fused[(layer, linear)] = _fuse(name, layer, modules, present, spec, tp_size, rank, max_rank, scaling,
                                           dtype)
    return LoraAdapter(name=name, path=path, rank=rank, fused=fused)


def output_widths(spec: ModelSpec, tp_size: int) -> dict[str, int]:
    """Each projection's output rows on one rank of `tp_size`."""
    kv_heads = max(1, spec.num_kv_heads // tp_size)
    inter = spec.intermediate_size // tp_size
    return {"q_proj": spec.num_heads // tp_size * spec.head_dim, "k_proj": kv_heads * spec.head_dim,
            "v_proj": kv_heads * spec.head_dim, "o_proj": spec.hidden_size, "gate_proj": inter, "up_proj": inter,
            "down_proj": spec.hidden_size}


def _fuse(name: str, layer: int, modules: tuple[str, ...], present: list[dict[str, torch.Tensor] | None],
          spec: ModelSpec, tp_size: int, rank: int, max_rank: int, scaling: float,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    widths = output_widths(spec, tp_size)
    outs = [widths[module] for module in modules]
    in_features = next(p["A"].shape[1] for p in present if p is not None and "A" in p)
    a = torch.zeros(in_features, len(modules) * max_rank, dtype=dtype)
    b = torch.zeros(len(modules) * max_rank, sum(outs), dtype=dtype)
    row = 0
    for band, (module, out, piece) in enumerate(zip(modules, outs, present)):
        if piece is not None:
            if set(piece) != {"A", "B"}:
                raise LoraLoadError(f"adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
            lora_a, lora_b = piece["A"], piece["B"]
            if lora_a.shape != (rank, in_features) or lora_b.shape != (out, rank):
                raise LoraLoadError(f"adapter {name!r}: layer {layer} {module} has A {tuple(lora_a.shape)}, B "
                                    f"{tuple(lora_b.shape)}; expected ({rank}, {in_features}) and ({out}, {rank})")
            columns = slice(band * max_rank, band * max_rank + rank)
            a[:, columns] = lora_a.T.to(dtype)
            b[columns, row:row + out] = (lora_b.float().T * scaling).to(dtype)
        row += out
    return a, b


def _shard(pieces: dict[tuple[int, str], dict[str, torch.Tensor]], spec: ModelSpec, tp_rank: int,
           tp_size: int) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """This rank's slices, cut by the base weights' own rule: a column-parallel projection's B by
    its output rows, a row-parallel one's A by its input columns; the other factor whole."""
    named: dict[str, torch.Tensor] = {}
    for (layer, module), piece in pieces.items():
        factor = "A" if module in ("o_proj", "down_proj") else "B"
        if factor in piece:
            named[f"model.layers.{layer}.{_PARENT_OF[module]}.{module}.weight"] = piece[factor]
    sharded = {key: tensor for key, tensor in shard_weights(named, spec, tp_rank, tp_size).items()
               if isinstance(tensor, torch.Tensor)}  # all of them: plain tensors in, plain slices out
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for (layer, module), piece in pieces.items():
        factor = "A" if module in ("o_proj", "down_proj") else "B"
        key = f"model.layers.{layer}.{_PARENT_OF[module]}.{module}.weight"
        out[(layer, module)] = {**piece, **({factor: sharded[key]} if key in sharded else {})}
    return out
