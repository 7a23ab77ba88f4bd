"""`vmesh bench claims`: the design's claims measured: async scheduling's duty cycle and the
stateful worker's bytes per step, on the embedded model and on a tiny one."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from vmesh.services.bench.common import load_workload, machine, mesh_generate
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.common.model_loading import resolve_model_dir


def tiny_model_dir(target: Path) -> Path:
    """A 2-layer Llama over the embedded model's tokenizer: its forward pass is fast enough that
    per-step overhead dominates, as it does on a GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    embedded = resolve_model_dir(None)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded / name).exists():
            shutil.copy(embedded / name, target / name)
    return target


def claims(args: argparse.Namespace) -> dict[str, Any]:
    work = load_workload(args.workload, args.requests, args.max_tokens)
    result: dict[str, Any] = {"mode": "claims", **machine(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            model_dir = (tiny_model_dir(Path(tmp) / "tiny") if model == "tiny"
                         else resolve_model_dir(args.model))
            rows = {}
            for depth in (1, 2):
                for stateless in (False, True):
                    name = f"depth{depth}-{'stateless' if stateless else 'stateful'}"
                    flags = ["--model", str(model_dir), "--pipeline-depth", str(depth),
                             "--kv-cache-memory", args.kv_cache_memory]
                    flags += ["--stateless-worker"] if stateless else []
                    mesh = start_mesh(*flags)
                    try:
                        rows[name] = asyncio.run(mesh_generate(mesh, work["prompts"], work["max_tokens"]))
                    finally:
                        mesh.stop()
            result["models"][model] = {
                "modes": rows,
                "duty_cycle_async_over_sync": (rows["depth2-stateful"]["duty_cycle"]
                                               / rows["depth1-stateful"]["duty_cycle"]),
                "bytes_stateless_over_stateful": (rows["depth2-stateless"]["bytes_per_decode_step"]
                                                  / rows["depth2-stateful"]["bytes_per_decode_step"]),
                "tokens_per_s_async_over_sync": (rows["depth2-stateful"]["tokens_per_s"]
                                                 / rows["depth1-stateful"]["tokens_per_s"]),
            }
    for model, m in result["models"].items():
        print(f"\n{model}: {'mode':>18} {'tok/s':>8} {'duty':>6} {'bytes/step':>11}")
        for name, r in m["modes"].items():
            print(f"{'':>{len(model) + 1}} {name:>18} {r['tokens_per_s']:>8.1f} {r['duty_cycle']:>6.3f} "
                  f"{r['bytes_per_decode_step']:>11.0f}")
        print(f"  duty cycle async/sync {m['duty_cycle_async_over_sync']:.3f}; throughput async/sync "
              f"{m['tokens_per_s_async_over_sync']:.2f}; "
              f"bytes stateless/stateful {m['bytes_stateless_over_stateful']:.1f}")
    return result
