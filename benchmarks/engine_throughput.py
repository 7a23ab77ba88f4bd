"""In-process engine vs transformers `generate` on the standard workload
(benchmarks/standard-64x128.json: 64 chat prompts as token ids, 128 greedy tokens each, EOS
ignored), side by side in one run.

    .venv/bin/python -m benchmarks.engine_throughput [--requests 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from services.common.model_loading import resolve_model_dir
from services.common.sampling_params import SamplingParams
from services.engine.llm import EngineConfig, LLMEngine
from services.worker.model_runner import WorkerConfig

WORKLOAD = Path(__file__).with_name("standard-64x128.json")


def transformers_generate(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, generation_config=config)
        elapsed = time.perf_counter() - started
    assert out.shape[1] - width == max_tokens
    return len(prompts) * max_tokens / elapsed


def engine_generate(model_dir: Path, prompts: list[list[int]], max_tokens: int, depth: int) -> float:
    engine = LLMEngine.from_config(EngineConfig(worker=WorkerConfig(model=str(model_dir), kv_cache_memory=1 << 30,
                                                                    max_num_seqs=len(prompts)),
                                                pipeline_depth=depth))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    engine.shutdown()
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return len(prompts) * max_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    workload = json.loads(WORKLOAD.read_text())
    prompts = workload["prompt_token_ids"][:args.requests]
    model_dir = resolve_model_dir(None)
    results = {
        "transformers_generate": transformers_generate(model_dir, prompts, args.max_tokens),
        "engine_depth1": engine_generate(model_dir, prompts, args.max_tokens, 1),
        "engine_depth2": engine_generate(model_dir, prompts, args.max_tokens, 2),
    }
    base = results["transformers_generate"]
    for name, tps in results.items():
        print(f"{name:>22}: {tps:7.1f} tokens/s  ({tps / base:.2f}x transformers)")


if __name__ == "__main__":
    main()
