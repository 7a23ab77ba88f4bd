"""Milliseconds per decode step of the model runner alone, optionally with a profile.

B requests each hold a CONTEXT-token prompt in the KV cache; every timed step decodes one
token for each. The per-change figures in benchmarks/README.md come from this script.

--draft-tokens K: the runner speculates with n-gram drafts (SpeculativeConfig("ngram", K)) and
each step reserves K draft slots per request; the prompts repeat a 16-token passage, so that
each step verifies 1 + K rows per request (the mean rows per step is printed).

--breakdown: milliseconds per step by op (benchmarks/step_breakdown.py): the runner's parts, the
model's ops (linears by kind, norms, attention, ...), the C kernels inside them, and the Python
between them.

--stack-ab: the decoder layers as one C call (services/worker/decoder_stack.py: native weights)
against the same layers one by one, alternating in one process.

--interference PERCENT: while the steps are timed, another process keeps a core busy for PERCENT
% of every 10 ms, as the mesh's frontend, scheduler and detokenizer do beside its worker (~10 %
of a core under a 32-stream burst, issue 35's measurement): how much a step loses when one of its
threads is descheduled now and then.

--baseline-ref REF: the same measurement over a temporary worktree of REF too, each tree in its
own process, alternating in --rounds rounds (before and after in one sitting); prints each
round's figures, the medians and this / baseline. With --threads 1 (the breakdown too) the
clock is the process's CPU time, which a shared machine's descheduling does not inflate.

    .venv/bin/python -m benchmarks.decode_step --batch 64 --context 128 [--steps 10] [--profile]
    .venv/bin/python -m benchmarks.decode_step --batch 1 --attention-backend torch --no-small-batch-linear
    .venv/bin/python -m benchmarks.decode_step --batch 64 --dtype bfloat16 --profile   (or --weights native|int8)
    .venv/bin/python -m benchmarks.decode_step --batch 1 --weights native --draft-tokens 4 --breakdown
    .venv/bin/python -m benchmarks.decode_step --batch 1 --weights native --threads 1 --baseline-ref main --rounds 5
    .venv/bin/python -m benchmarks.decode_step --batch 1 --weights native --context 256 --rounds 12 --stack-ab
    .venv/bin/python -m benchmarks.decode_step --batch 64 --dtype bfloat16 --weights int8 --interference 10 \
        --baseline-ref HEAD
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.baseline_tree import baseline_trees
from vmesh.services.common.model_loading import embedded_model_file, load_model_spec, resolve_model_dir
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.worker.config import KV_CACHE_DTYPES
from vmesh.services.worker.kv_cache import bytes_per_block, kv_cache_dtype
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

WARMUP_STEPS = 3
PASSAGE = 16  # --draft-tokens: the prompts repeat a passage of this many tokens
# Runs the script at argv[1] as __main__ with the arguments after it (the working directory first
# on the import path, where running it by path would put benchmarks/ there instead).
RUN_SCRIPT = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


# A core busy for argv[1] % of every 10 ms period: says "ready" once running, and stops when
# its parent does (were the benchmark killed, it would skew every later measurement).
BUSY_LOOP = """import os, sys, time
busy, parent = float(sys.argv[1]) / 100 * 0.010, os.getppid()
print("ready", flush=True)
while os.getppid() == parent:
    started = time.perf_counter()
    while time.perf_counter() - started < busy:
        pass
    time.sleep(0.010 - busy)
"""


@contextlib.contextmanager
def interference(percent: float) -> Iterator[None]:
    """Another process busy for `percent` % of a core while the block runs (none at 0); the block
    starts once that process runs, so its start-up is not timed."""
    if not percent:
        yield
        return
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(percent)], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout is not None
        if busy.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the --interference process did not start (exit code {busy.poll()})")
        yield
    finally:
        busy.kill()
        busy.wait()


def measure(args: argparse.Namespace) -> dict:
    """Load the runner, fill the prompts and time the decode steps: ms per step and more."""
    torch.set_num_threads(args.threads)
    cpu_clock = args.threads == 1
    clock = time.process_time if cpu_clock else time.perf_counter
    rows_per_request = 1 + args.draft_tokens
    timed_steps = 2 * args.rounds * args.steps if args.stack_ab else args.steps
    decode_steps = WARMUP_STEPS + timed_steps + (5 if args.profile else 0)
    model = str(embedded_model_file() if args.weights == "native" else resolve_model_dir(None))
    speculative = SpeculativeConfig("ngram", args.draft_tokens) if args.draft_tokens else None
    config = WorkerConfig(model=model, max_num_seqs=args.batch, dtype=args.dtype, weights=args.weights,
                          attention_backend=args.attention_backend, small_batch_linear=not args.no_small_batch_linear,
                          speculative_config=speculative, kv_cache_dtype=args.kv_cache_dtype)
    block_size = config.block_size
    blocks_per_request = -(-(args.context + decode_steps * rows_per_request + args.draft_tokens) // block_size)
    spec = load_model_spec(resolve_model_dir(None))
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, torch.device("cpu"), getattr(torch, args.dtype))
    config.kv_cache_memory = args.batch * blocks_per_request * bytes_per_block(spec, block_size, kv_dtype)
    runner = ModelRunner.load(config)
    handles = list(range(args.batch))
    params = SamplingParams(temperature=args.temperature, max_tokens=decode_steps * rows_per_request + 1,
                            ignore_eos=True)
    plan = StepPlan(step=0, scheduled_handles=list(handles), num_scheduled_tokens=[args.context] * args.batch)
    for i in handles:
        if args.draft_tokens:
            passage = [1000 + (97 * j + 7 * i) % 20000 for j in range(PASSAGE)]
            prompt = (passage * -(-args.context // PASSAGE))[:args.context]
        else:
            prompt = [(7 * i + j) % 1000 + 1 for j in range(args.context)]
        blocks = list(range(i * blocks_per_request, (i + 1) * blocks_per_request))
        plan.new_requests.append(NewRequest(i, prompt, args.context, params, blocks))
    runner.execute(plan)
    step = 1
    rows = 0
    produced: list[int] = []

    def decode() -> None:
        nonlocal step, rows
        result = runner.execute(StepPlan(step, scheduled_handles=list(handles), num_scheduled_tokens=[1] * args.batch,
                                         num_draft_slots=[args.draft_tokens] * args.batch if args.draft_tokens
                                         else []))
        rows += args.batch + sum(result.num_draft_tokens)
        produced.extend(result.sampled_token_ids)
        step += 1

    for _ in range(WARMUP_STEPS):
        decode()
    if args.stack_ab:
        return stack_ab(runner, decode, clock, args)
    breakdown = None
    if args.breakdown:
        step_breakdown = sibling_module("step_breakdown")
        breakdown = step_breakdown.Breakdown(clock)
        step_breakdown.instrument(runner, breakdown)
    rows = 0
    with interference(args.interference):
        started = clock()
        for _ in range(args.steps):
            decode()
        elapsed = clock() - started
    result = {"ms_per_step": elapsed / args.steps * 1e3, "rows_per_step": rows / args.steps,
              "tokens_per_s": len(produced) / elapsed if not args.breakdown else None,
              "clock": "process CPU" if cpu_clock else "wall", "attention": runner.backend.name,
              "output_digest": hash(tuple(produced)) & 0xFFFFFFFF}
    if breakdown is not None:
        result["breakdown"] = breakdown.report()
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(5):
                decode()
        result["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return result


def stack_ab(runner: ModelRunner, decode: Callable[[], None], clock: Callable[[], float],
             args: argparse.Namespace) -> dict:
    """ms per step with the decoder layers as one C call and one by one (services/worker/
    decoder_stack.py), in blocks of --steps steps alternating in --rounds rounds in this process."""
    if runner.model.decoder_stack is None:
        raise SystemExit("--stack-ab: the decoder stack does not serve this model (services/worker/decoder_stack.py)")
    figures: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.rounds):
        for enabled in (True, False) if i % 2 == 0 else (False, True):
            runner.model.decoder_stack_enabled = enabled
            started = clock()
            for _ in range(args.steps):
                decode()
            figures[enabled].append((clock() - started) / args.steps * 1e3)
    stack, one_by_one = (statistics.median(figures[enabled]) for enabled in (True, False))
    return {"ms_per_step": stack, "ms_per_step_one_by_one": one_by_one, "rounds": figures,
            "clock": "process CPU" if args.threads == 1 else "wall", "attention": runner.backend.name,
            "tokens_per_s": None}


def sibling_module(name: str) -> ModuleType:
    """A module beside this file, whichever tree's `benchmarks` package is importable (a
    --baseline-ref child imports the baseline's)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None, f"benchmarks/{name}.py is beside this script"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def describe(args: argparse.Namespace, result: dict) -> str:
    drafts = f", {args.draft_tokens} draft slots ({result['rows_per_step']:.1f} rows/step)" if args.draft_tokens else ""
    rate = f", {result['tokens_per_s']:.1f} tokens/s" if result["tokens_per_s"] else ""
    cache = "" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype} KV cache"
    return (f"{args.dtype} {args.weights}{cache}, batch {args.batch}, context {args.context}{drafts}, attention "
            f"{result['attention']}, {args.threads} threads: {result['ms_per_step']:.2f} ms/step "
            f"({result['clock']}){rate}")


def compare(args: argparse.Namespace, argv: list[str]) -> None:
    """Each round runs this script once per tree (in a process of its own), alternating."""
    child_argv = [a for i, a in enumerate(argv) if a not in ("--baseline-ref", "--rounds")
                  and (i == 0 or argv[i - 1] not in ("--baseline-ref", "--rounds"))]
    figures: dict[str, list[float]] = {}
    last: dict[str, dict] = {}
    with baseline_trees(args.baseline_ref) as by_name:
        for i in range(args.rounds):
            for name, tree in by_name.items():
                # Every tree runs this checkout's script (a baseline's may predate --json) over the
                # tree's own package: with the tree as the working directory and import path.
                done = subprocess.run([sys.executable, "-c", RUN_SCRIPT, str(Path(__file__).resolve()), *child_argv,
                                       "--json"], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                                      capture_output=True, text=True, check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                figures.setdefault(name, []).append(result["ms_per_step"])
                print(f"round {i + 1} {name}: {describe(args, result)}, output {result['output_digest']:08x}",
                      flush=True)
                last[name] = result
    for name, result in last.items():
        if "breakdown" in result:
            print(f"breakdown, {name} (last round):\n{result['breakdown']}")
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print("median ms/step: " + ", ".join(f"{name} {ms:.2f}" for name, ms in medians.items())
          + f"; this / {args.baseline_ref}: {medians['this'] / medians[args.baseline_ref]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=128, help="cached prompt tokens per request")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--no-small-batch-linear", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a torch profile of 5 more steps")
    parser.add_argument("--breakdown", action="store_true", help="print milliseconds per step by op")
    parser.add_argument("--draft-tokens", type=int, default=0, help="n-gram speculation with this many drafts")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample every row at this temperature (0: greedy; clients that send none get 1)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--weights", default="dequantized", choices=("dequantized", "native", "int8"),
                        help="native reads the embedded GGUF file's blocks")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the worker's --kv-cache-dtype (int8: the 8-bit cache)")
    parser.add_argument("--interference", type=float, default=0.0,
                        help="keep a core busy this %% of the time in another process while timing")
    parser.add_argument("--baseline-ref", help="also time a worktree of this git ref, alternating rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stack-ab", action="store_true",
                        help="time the decoder stack (one C call) against the layers one by one in this process, "
                             "alternating --rounds rounds of --steps steps")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a --baseline-ref child's output
    args = parser.parse_args()
    if args.interference and not 0 < args.interference < 100:
        parser.error(f"--interference is a percentage of one core in (0, 100), got {args.interference}")
    if args.interference and (args.threads == 1 or args.stack_ab):
        parser.error("--interference times a step on the wall clock beside another process: not with --threads 1 "
                     "(whose clock is the process's CPU time) or --stack-ab")
    if args.stack_ab and (args.baseline_ref or args.draft_tokens or args.breakdown or args.profile):
        parser.error("--stack-ab times the stack against the layers one by one alone: no --baseline-ref, "
                     "--draft-tokens, --breakdown or --profile")
    if args.baseline_ref:
        compare(args, sys.argv[1:])
        return
    result = measure(args)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "profile"}))
        return
    print(describe(args, result))
    if args.stack_ab:
        print(f"layers one by one: {result['ms_per_step_one_by_one']:.2f} ms/step; the stack / one by one: "
              f"{result['ms_per_step'] / result['ms_per_step_one_by_one']:.3f} (medians of {args.rounds} rounds; "
              f"stack {[round(x, 2) for x in result['rounds'][True]]}, one by one "
              f"{[round(x, 2) for x in result['rounds'][False]]})")
    for part in ("breakdown", "profile"):
        if part in result:
            print(result[part])


if __name__ == "__main__":
    main()
