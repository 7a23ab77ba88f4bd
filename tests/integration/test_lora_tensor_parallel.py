"""LoRA adapters under tensor parallelism: two gloo ranks on the CPU each hold their share of a tiny
Llama and of its adapters (B's rows of the column-parallel projections, A's columns of the
row-parallel ones); a mixed batch of the base model and two adapters gives peft's greedy tokens on
rank 0, and every rank samples the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.checkout import ROOT
from tests.support.lora_adapters import RECIPES, assert_peft_greedy, make_peft_model
from tests.support.plan_driver import DrivenRequest, drive
from tests.support.tiny_models import TINY_VOCAB, save_tiny_llama
from vmesh.services.launcher import free_port
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

RANK_TIMEOUT_S = 240
MAX_TOKENS = 8


def _cases() -> list[tuple[list[int], str]]:
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in (9, 23, 4, 17)]
    return [(prompts[0], ""), (prompts[1], "sql"), (prompts[2], "poet"), (prompts[3], "sql"), (prompts[1], "")]


def rank_main() -> None:
    """One rank: argv[1] is a JSON object of its arguments; its outputs go to `out`."""
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    runner = ModelRunner.load(WorkerConfig(
        model=args["model"], kv_cache_memory=4 << 20, max_num_seqs=8, tensor_parallel_size=2,
        tensor_parallel_rank=args["rank"], tensor_parallel_init=f"127.0.0.1:{args['port']}",
        lora_modules=args["modules"], max_loras=2, max_lora_rank=16))
    requests = [DrivenRequest(p, MAX_TOKENS, lora_name=name, join_step=i) for i, (p, name) in enumerate(_cases())]
    drive(runner, requests, chunk=7)
    Path(args["out"]).write_text(json.dumps([r.output for r in requests]))
    runner.model.parallel.close()
    # Out without the interpreter's teardown, as a serving worker leaves: teardown could meet the
    # heartbeat thread inside a barrier that peers already gone never join (seen once: rank 0
    # waited out the 30 s heartbeat timeout, then aborted, exit -6).
    sys.stdout.flush()
    os._exit(0)


def test_lora_tp2_matches_peft(tmp_path):
    model_dir = tmp_path / "model"
    save_tiny_llama(model_dir)
    peft_model, paths = make_peft_model(model_dir, tmp_path / "adapters", RECIPES[:2], b_std=0.3)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    modules = [f"{name}={path}" for name, path in paths.items()]
    procs = [subprocess.Popen(
        [sys.executable, "-c", "from tests.integration.test_lora_tensor_parallel import rank_main; rank_main()",
         json.dumps({"model": str(model_dir), "rank": rank, "port": port, "modules": modules, "out": str(outs[rank])})],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    try:
        for proc in procs:
            output = proc.communicate(timeout=RANK_TIMEOUT_S)[0].decode()
            assert proc.returncode == 0, output[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    rank0, rank1 = (json.loads(out.read_text()) for out in outs)
    assert rank1 == rank0
    cases = _cases()
    assert_peft_greedy(peft_model, [(p, out, name) for (p, name), out in zip(cases, rank0)])
    assert rank0[1] != rank0[4], "the adapter changes the tokens of a prompt the base model also ran"
