"""`vmesh bench offline --baselines mesh-lora`: seeded random LoRA adapters for the benchmarked
model, written in PEFT's format (nothing is downloaded), and the mesh that serves them. The
workload then runs twice more on that mesh: its requests spread over the four adapters in turn
(`mesh-lora`), and all of them under one adapter (`mesh-lora-1`), beside the base model alone
(`mesh`) in the same rounds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vmesh.services.common.model_loading import load_model_spec

NUM_ADAPTERS = 4
RANK = 16
_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapters(model_dir: Path, out: Path, count: int = NUM_ADAPTERS, rank: int = RANK) -> dict[str, str]:
    """{name: directory} of `count` adapters of `rank` on every projection, seeded by their index."""
    spec = load_model_spec(model_dir)
    q, kv, hidden, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, \
        spec.intermediate_size
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    paths: dict[str, str] = {}
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(spec.num_layers):
            for module, (rows, columns) in shapes.items():
                prefix = f"base_model.model.model.layers.{layer}.{_MODULES[module]}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, columns, generator=generator) / columns ** 0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * 0.01
        directory = out / f"lora-{index}"
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes), "bias": "none"}))
        paths[f"lora-{index}"] = str(directory)
    return paths


def lora_flags(paths: dict[str, str]) -> tuple[str, ...]:
    return ("--lora-modules", ",".join(f"{name}={path}" for name, path in paths.items()),
            "--max-loras", str(len(paths)), "--max-lora-rank", str(RANK))
