"""Tensor parallelism over gloo on the CPU: every rank a separate process, meeting on 127.0.0.1.

Each rank loads its share of the model through ModelRunner.load and runs the same plans; rank 0's
tokens must equal those of one unsharded worker (greedy and seeded sampling), and every rank must
have sampled the same tokens as rank 0 (it keeps them in its own persistent batch). The embedded
model runs under the in-process engine at pipeline depth 1 and 2: rank 0's engine plans, and
each plan goes to the other ranks before rank 0 executes it, as the mesh scheduler sends every
rank each plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.checkout import ROOT
from tests.support.plan_driver import DrivenRequest, drive
from tests.support.tiny_models import TINY_VOCAB, save_tiny_llama, save_tiny_qwen2
from vmesh.services.common.types import SamplingParams, StructuredOutput
from vmesh.services.launcher import free_port
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.tensor_parallel import GROUP_FAILED_EXIT_CODE

RANK_TIMEOUT_S = 240
ENGINE_PROMPTS = ["What is the capital of France?", "List three prime numbers.", "Why is the sky blue?"]


def _config(model: str, size: int = 1, rank: int = 0, port: int = 0, kv_cache_memory: int = 4 << 20) -> WorkerConfig:
    return WorkerConfig(model=model, kv_cache_memory=kv_cache_memory, max_num_seqs=8, tensor_parallel_size=size,
                        tensor_parallel_rank=rank, tensor_parallel_init=f"127.0.0.1:{port}" if size > 1 else "")


# --- what each rank runs -------------------------------------------------------------------------

def tiny_scenario(runner: ModelRunner) -> dict[str, Any]:
    """Greedy requests (ragged, joining late, chunked prefill), then seeded and unseeded sampling."""
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, runner.spec.vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 40, 1, 33)]
    greedy = [DrivenRequest(p, 16, join_step=2 * i) for i, p in enumerate(prompts)]
    drive(runner, greedy, chunk=7)
    runner.reset()
    sampled = [DrivenRequest(p, 16, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11 + i), join_step=i)
               for i, p in enumerate(prompts[:3])]
    sampled.append(DrivenRequest(prompts[3], 16, SamplingParams(temperature=1.0), join_step=1))  # unseeded
    drive(runner, sampled, chunk=7)
    runner.reset()
    key_cache = runner.kv_cache.key_caches[0]
    return {"greedy": [r.output for r in greedy], "seeded": [r.output for r in sampled[:3]],
            "unseeded": sampled[3].output, "num_kv_blocks": runner.kv_cache.num_blocks,
            "kv_heads": key_cache.shape[2]}


def engine_scenario(runner: ModelRunner, model: str) -> dict[str, Any]:
    """Rank 0: the engine at pipeline depth 1 and 2, each plan sent first to every other rank."""
    import torch.distributed as dist

    from vmesh.services.common.model_loading import load_tokenizer, resolve_model_dir
    from vmesh.services.engine.llm import EngineConfig, LLMEngine

    parallel = runner.model.parallel
    plans = dist.new_group(backend="gloo") if parallel is not None else None
    if parallel is not None and parallel.rank != 0:
        while True:  # follow rank 0's plans until it says it is done
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=plans)
            if box[0] is None:
                return {}
            if box[0] == "reset":
                runner.reset()
                continue
            runner.execute(box[0])
    execute = runner.execute

    def execute_everywhere(plan):
        if plans is not None:
            dist.broadcast_object_list([plan], src=0, group=plans)
        return execute(plan)

    runner.execute = execute_everywhere  # type: ignore[method-assign]
    tokenizer = load_tokenizer(resolve_model_dir(model))
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False) for p in ENGINE_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for depth in (1, 2):
        runner.reset()  # each engine numbers its steps from 0
        if plans is not None:
            dist.broadcast_object_list(["reset"], src=0, group=plans)
        engine = LLMEngine(runner, tokenizer, EngineConfig(max_num_batched_tokens=32, pipeline_depth=depth))
        outputs[f"depth{depth}"] = [o.token_ids for o in engine.generate(prompt_ids, params)]
        if depth == 2:  # depth 1 against 2 with a grammar: test_structured_parity's (unsharded) check
            # Every rank masks the same gathered logits with its own matchers: the same constrained tokens.
            outputs["structured"] = [o.token_ids for o in engine.generate(prompt_ids, STRUCTURED)]
        engine.shutdown()
    if plans is not None:
        dist.broadcast_object_list([None], src=0, group=plans)
    return outputs


STRUCTURED = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput("json_schema", json.dumps({
    "type": "object", "additionalProperties": False, "required": ["answer", "sure"],
    "properties": {"answer": {"type": "string", "maxLength": 40}, "sure": {"type": "boolean"}}})))


def rank_main() -> None:
    """One rank's process: argv[1] is a JSON object of its arguments; its results go to `out`."""
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    runner = ModelRunner.load(_config(args["model"], args["size"], args["rank"], args["port"], args["kv"]))
    if args["scenario"] == "die":
        if args["rank"] == 1:
            os._exit(7)  # gone without a word; rank 0 must notice and exit, not wait
        time.sleep(RANK_TIMEOUT_S)
        return
    result = tiny_scenario(runner) if args["scenario"] == "tiny" else engine_scenario(runner, args["model"])
    Path(args["out"]).write_text(json.dumps(result))
    runner.model.parallel.close()
    # Out without the interpreter's teardown, as a serving worker leaves: teardown could meet the
    # heartbeat thread inside a barrier that peers already gone never join (seen once: rank 0
    # waited out the 30 s heartbeat timeout, then aborted, exit -6).
    sys.stdout.flush()
    os._exit(0)


# --- the test side ---------------------------------------------------------------------------

def run_group(tmp_path: Path, model: str, size: int, scenario: str, kv: int = 4 << 20,
              timeout: float = RANK_TIMEOUT_S) -> tuple[list[int | None], list[dict[str, Any] | None]]:
    """Start `size` rank processes, wait for them all, and return their exit codes and results;
    every process is killed on the way out, whatever happened."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"{scenario}-rank{r}.json" for r in range(size)]
    procs = []
    try:
        for rank in range(size):
            args = json.dumps({"model": model, "size": size, "rank": rank, "port": port, "kv": kv,
                               "scenario": scenario, "out": str(outs[rank])})
            procs.append(subprocess.Popen(
                [sys.executable, "-c", "from tests.integration.test_tensor_parallel import rank_main; rank_main()",
                 args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        if scenario != "die" and any(code != 0 for code in codes):
            logs = "\n".join(f"--- rank {r} (exit {c}) ---\n" + p.stdout.read().decode()[-3000:]  # type: ignore
                             for r, (p, c) in enumerate(zip(procs, codes)) if c is not None)
            pytest.fail(f"rank processes failed: exit codes {codes}\n{logs}")
        return codes, [json.loads(o.read_text()) if o.is_file() else None for o in outs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout:
                proc.stdout.close()


def run_unsharded(model: str, scenario: str, kv: int = 4 << 20) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same kernels' reduction order
    try:
        runner = ModelRunner.load(_config(model, kv_cache_memory=kv))
        return tiny_scenario(runner) if scenario == "tiny" else engine_scenario(runner, model)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_tp2_matches_tp1(tmp_path, kind):
    (save_tiny_qwen2 if kind == "qwen2" else save_tiny_llama)(tmp_path)  # 6 heads, 2 KV heads: one per rank
    expected = run_unsharded(str(tmp_path), "tiny")
    _codes, results = run_group(tmp_path, str(tmp_path), 2, "tiny")
    rank0, rank1 = results
    assert rank0 is not None and rank1 is not None
    assert rank0["greedy"] == expected["greedy"]
    assert rank0["seeded"] == expected["seeded"]
    # Every rank samples what rank 0 samples, unseeded draws included: each keeps its own tokens.
    assert rank1 == rank0
    assert rank0["kv_heads"] == 1 and expected["kv_heads"] == 2
    # Half the KV heads per rank: the same memory holds twice the blocks.
    assert rank0["num_kv_blocks"] == 2 * expected["num_kv_blocks"]


def test_tiny_kv_heads_replicated_beyond_their_count(tmp_path):
    """4 ranks, 2 KV heads: each KV head lives on two ranks, greedy output unchanged. The vocabulary
    does not divide by 4 either: the last rank's slice is narrower."""
    save_tiny_llama(tmp_path, num_attention_heads=8, hidden_size=128, vocab_size=TINY_VOCAB - 2)
    expected = run_unsharded(str(tmp_path), "tiny")
    _codes, results = run_group(tmp_path, str(tmp_path), 4, "tiny")
    assert all(r is not None and r["kv_heads"] == 1 for r in results)
    assert results[0]["greedy"] == expected["greedy"]  # type: ignore[index]
    assert results[0]["seeded"] == expected["seeded"]  # type: ignore[index]
    assert all(r == results[0] for r in results)


def test_embedded_tp3_engine_depths(tmp_path, embedded_model_dir):
    """9 attention heads and 3 KV heads over three ranks, through the engine at depth 1 and 2,
    and with a JSON schema at depth 2 (the model's heads divide by 3, not by 2)."""
    expected = run_unsharded(str(embedded_model_dir), "engine", kv=16 << 20)
    assert expected["depth1"] == expected["depth2"]
    _codes, results = run_group(tmp_path, str(embedded_model_dir), 3, "engine", kv=16 << 20)
    assert results[0] is not None
    assert results[0]["depth1"] == expected["depth1"]
    assert results[0]["depth2"] == expected["depth2"]
    assert results[0]["structured"] == expected["structured"]


def test_a_rank_that_dies_ends_the_group(tmp_path):
    """Rank 1 exits after loading; rank 0, idle, notices through the heartbeat and exits too
    (a group cannot take a restarted rank back), instead of waiting on it."""
    save_tiny_llama(tmp_path)
    started = time.monotonic()
    codes, _results = run_group(tmp_path, str(tmp_path), 2, "die", timeout=120)
    assert codes == [GROUP_FAILED_EXIT_CODE, 7]
    assert time.monotonic() - started < 120
