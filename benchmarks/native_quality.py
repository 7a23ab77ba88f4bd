"""What `--weights native` on int8 dot products costs in quality: perplexity and greedy agreement
against the float32 paths, on the embedded model (SmolLM2-135M-Instruct, a Q4_1 GGUF file).

Modes: `dequantized` (the file's weights expanded to float32 at load: the float32 reference),
`native-float` (today's native kernel, float32 products over the blocks: VMESH_QUANTIZED_DOT=float)
`native-int8` (activations rounded to int8 per block of 32, VNNI dot products), `int8` (`--weights
int8` on the dequantized float32 checkpoint: int8 weights per output feature; activations to 16 bits
per token below 8 rows, to 8 bits per block of 64 from 8 rows, so perplexity's 255-row chunks measure
the latter), and the mixed bfloat16 model (`--dtype bfloat16`) as `bf16` and `int8-bf16`; `kv8`,
`bf16-kv8` and `int8-bf16-kv8` are `dequantized`, `bf16` and `int8-bf16` over the 8-bit KV cache
(`--kv-cache-dtype int8`).

(a) Perplexity over benchmarks/data/bf16_perplexity.txt, measured as benchmarks/bf16.py does
(teacher-forced in 256-token chunks through the paged cache). (b) Greedy outputs of the standard
workload's prompts (EOS ignored) in each mode: the fraction of identical requests and the mean
leading match against `native-float` (or, without it, `dequantized`, else the first mode); for every
request that differs, the margin at its first difference under the reference's own logits
(log-probability of its token minus that of the token the other mode chose).

    .venv/bin/python -m benchmarks.native_quality [--requests 64] [--max-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bf16 import TEXT, agreement, perplexity
from vmesh.services.bench.common import load_workload
from vmesh.services.common.model_loading import load_tokenizer, resolve_model_dir
from vmesh.services.common.tokenizer import load_chat_tokenizer
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.worker.attention import AttentionMetadata
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.quantized_linear import DOT_ENV

# mode: (weights, VMESH_QUANTIZED_DOT, dtype, kv_cache_dtype)
MODES = {"dequantized": ("dequantized", None, "float32", "auto"),
         "native-float": ("native", "float", "float32", "auto"), "native-int8": ("native", "int8", "float32", "auto"),
         "int8": ("int8", None, "float32", "auto"), "bf16": ("dequantized", None, "bfloat16", "auto"),
         "int8-bf16": ("int8", None, "bfloat16", "auto"), "kv8": ("dequantized", None, "float32", "int8"),
         "bf16-kv8": ("dequantized", None, "bfloat16", "int8"), "int8-bf16-kv8": ("int8", None, "bfloat16", "int8")}
DEFAULT_MODES = ["dequantized", "native-float", "native-int8", "int8"]


def load(mode: str, **settings: Any) -> ModelRunner:
    weights, dot, dtype, kv_cache_dtype = MODES[mode]
    if dot is None:
        os.environ.pop(DOT_ENV, None)
    else:
        os.environ[DOT_ENV] = dot  # read as the layers are built
    return ModelRunner.load(WorkerConfig(weights=weights, dtype=dtype, kv_cache_dtype=kv_cache_dtype, **settings))


def log_probs(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab] float32 log-probabilities of each next token, one request in one chunk."""
    n = len(token_ids) - 1
    blocks = -(-len(token_ids) // runner.kv_cache.block_size)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None, :], query_lens_cpu=[n],
                             seq_lens_cpu=[n])
    logits = runner.model.forward(torch.tensor(token_ids[:n]), torch.arange(n), meta, runner.kv_cache,
                                  runner.backend, torch.arange(n))
    return torch.log_softmax(logits.float(), dim=-1)


def margins(runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]],
            other: list[list[int]]) -> list[dict[str, float]]:
    """For each differing request: where, and the reference's log-prob margin of its token over other's."""
    found = []
    for index, (prompt, ours, theirs) in enumerate(zip(prompts, reference, other)):
        position = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if position is None:
            continue
        scores = log_probs(runner, [*prompt, *ours[:position + 1]])[-1]
        found.append({"request": index, "position": position,
                      "margin": float(scores[ours[position]] - scores[theirs[position]])})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=None, help="default: all of the workload's (64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the workload's (128)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here too")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None)
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "perplexity": {}}
    token_ids = load_tokenizer(model_dir)(args.text.read_text())["input_ids"]
    for mode in args.modes:
        runner = load(mode, kv_cache_memory=256 << 20)
        result["perplexity"][mode] = perplexity(runner, token_ids)
        print(f"perplexity {mode}: {result['perplexity'][mode]:.4f} ({len(token_ids)} tokens)", flush=True)
        del runner

    work = load_workload("standard", args.requests, args.max_tokens)
    prompts, max_tokens = work["prompts"], work["max_tokens"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokenizer = load_chat_tokenizer(model_dir)
    outputs: dict[str, list[list[int]]] = {}
    for mode in args.modes:
        engine = LLMEngine(load(mode, max_num_seqs=256), tokenizer, EngineConfig())
        try:
            started = time.perf_counter()
            outputs[mode] = [o.token_ids for o in engine.generate(prompts, params)]
            print(f"{mode}: {len(prompts)} requests x {max_tokens} tokens in {time.perf_counter() - started:.1f} s",
                  flush=True)
        finally:
            engine.shutdown()
    result["requests"], result["max_tokens"] = len(prompts), max_tokens
    base = next(mode for mode in ("native-float", "dequantized", *args.modes) if mode in outputs)
    result["reference"] = base
    reference = load(base, kv_cache_memory=64 << 20)
    for mode in outputs.keys() - {base}:
        result.setdefault("agreement", {})[mode] = agreement(outputs[base], outputs[mode])
        differing = margins(reference, prompts, outputs[base], outputs[mode])
        result.setdefault("first_differences", {})[mode] = differing
        if differing:
            result.setdefault("margin_median", {})[mode] = statistics.median(d["margin"] for d in differing)
            result.setdefault("margin_max", {})[mode] = max(d["margin"] for d in differing)
    os.environ.pop(DOT_ENV, None)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
