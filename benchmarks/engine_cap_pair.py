"""The in-process engine's offline throughput with and without the decode-first cap
(max_prefill_tokens_with_decodes), alternating in one sitting: each run a process of its own that
loads the engine, warms it up and generates the workload once, the two settings taking turns (the
order flipping every round) so that the machine's drift reaches both.

    .venv/bin/python -m benchmarks.engine_cap_pair [--workload medium] [--dtype bfloat16] [--cap 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_once(workload: str, dtype: str, cap: int) -> float:
    """Output tokens per second of one engine over the whole workload (in this process)."""
    from vmesh.services.bench.common import for_model, load_workload
    from vmesh.services.common.model_loading import resolve_model_dir
    from vmesh.services.common.types import SamplingParams
    from vmesh.services.engine.llm import EngineConfig, LLMEngine
    from vmesh.services.worker.model_runner import WorkerConfig

    model_dir = resolve_model_dir(None)
    with tempfile.TemporaryDirectory() as scratch:
        work = for_model(load_workload(workload, None, None), model_dir, model_dir, Path(scratch))
    prompts, max_tokens = work["prompts"], work["max_tokens"]
    engine = LLMEngine.from_config(EngineConfig(
        worker=WorkerConfig(model=str(model_dir), max_num_seqs=256, kv_cache_memory=1 << 30, dtype=dtype),
        max_prefill_tokens_with_decodes=cap))
    try:
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        engine.reset_prefix_cache()
        started = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        elapsed = time.perf_counter() - started
    finally:
        engine.shutdown()
    assert all(len(o.token_ids) == max_tokens for o in outputs)
    return len(prompts) * max_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="medium")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--cap", type=int, default=256, help="the capped setting (the mesh's default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: run this cap once, print JSON
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps({"tokens_per_s": run_once(args.workload, args.dtype, args.one)}))
        return
    figures: dict[int, list[float]] = {args.cap: [], 0: []}
    for i in range(args.rounds):
        for cap in (args.cap, 0) if i % 2 == 0 else (0, args.cap):
            done = subprocess.run([sys.executable, "-m", "benchmarks.engine_cap_pair", "--workload", args.workload,
                                   "--dtype", args.dtype, "--one", str(cap)], capture_output=True, text=True,
                                  check=True)
            figures[cap].append(json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"])
            print(f"round {i + 1}, cap {cap or 'none'}: {figures[cap][-1]:.1f} tok/s", flush=True)
    capped, uncapped = statistics.median(figures[args.cap]), statistics.median(figures[0])
    pairs = [u / c for u, c in zip(figures[0], figures[args.cap])]
    print(f"medians: cap {args.cap} {capped:.1f}, none {uncapped:.1f} tok/s; none / cap {uncapped / capped:.3f}; "
          f"per round {', '.join(f'{r:.2f}' for r in pairs)} (median {statistics.median(pairs):.2f})")


if __name__ == "__main__":
    main()
