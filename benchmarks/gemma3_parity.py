"""Gemma 3 270M (the `gemma` extra): greedy tokens of the in-process engine against transformers
float32 loading the same GGUF, on 20 plain-text completion prompts from 6 to 4,096 tokens (ten
short ones, ten past the 512-token window), and how long each side took. The CI test
(tests/integration/test_gemma3.py) is three of these prompts.

    nice -n 10 .venv/bin/python -m benchmarks.gemma3_parity [--new-tokens 32] [--weights native]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from tests.support.gemma3 import SHORT_PROMPTS, gemma3_files, long_prompt, reference_model
from tests.support.reference import NEAR_TIE, hf_greedy
from vmesh.services.common.model_loading import GEMMA3_MODEL_ALIAS
from vmesh.services.common.tokenizer import load_chat_tokenizer
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

LONG_LENGTHS = (520, 800, 1200, 1600, 2000, 2500, 3000, 3500, 4000, 4096)


def first_divergence(ours: list[int], reference, label: str) -> dict:
    for i, (a, b) in enumerate(zip(ours, reference.token_ids)):
        if a != b:
            top2 = reference.logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            return {"prompt": label, "at": i, "near_tie": gap < NEAR_TIE, "gap": gap}
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--weights", choices=["dequantized", "native"], default="dequantized")
    parser.add_argument("--out", default="benchmarks/results/gemma3_parity.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    gguf, model_dir = gemma3_files()
    tokenizer = load_chat_tokenizer(model_dir)
    prompts = [tokenizer.encode(t) for t in SHORT_PROMPTS]
    prompts += [long_prompt(tokenizer, n, offset=97 * i) for i, n in enumerate(LONG_LENGTHS)]

    started = time.perf_counter()
    reference = reference_model(gguf)
    hf_load = time.perf_counter() - started
    started = time.perf_counter()
    references = [hf_greedy(reference, p, args.new_tokens) for p in prompts]
    hf_generate = time.perf_counter() - started
    del reference

    started = time.perf_counter()
    runner = ModelRunner.load(WorkerConfig(model=GEMMA3_MODEL_ALIAS, weights=args.weights, max_num_seqs=4,
                                           max_model_len=4096 + 64))
    vmesh_load = time.perf_counter() - started
    engine = LLMEngine(runner, tokenizer, EngineConfig(max_num_batched_tokens=512, pipeline_depth=2))
    try:
        started = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
        vmesh_generate = time.perf_counter() - started
    finally:
        engine.shutdown()
    divergences = [d for i, out in enumerate(outs)
                   if (d := first_divergence(out.token_ids, references[i], f"{i} ({len(prompts[i])} tokens)"))]
    exact = sum(out.token_ids == references[i].token_ids for i, out in enumerate(outs))
    result = {
        "command": f"python -m benchmarks.gemma3_parity --new-tokens {args.new_tokens} --weights {args.weights}",
        "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
        "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens,
        "identical": exact, "prompts": len(prompts), "divergences": divergences,
        "seconds": {"transformers_load": round(hf_load, 1), "transformers_generate": round(hf_generate, 1),
                    "vmesh_load": round(vmesh_load, 1), "vmesh_generate": round(vmesh_generate, 1)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
