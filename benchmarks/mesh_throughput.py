"""The mesh vs the in-process engine on the standard workload, and the seed's claims in the
four combinations of pipeline depth (1, 2) and worker mode (stateless, stateful): output
tokens/s, the worker's duty cycle (forward + sampling time over wall time, counted by the
worker) and plan bytes per decode step from scheduler to worker.

    .venv/bin/python -m benchmarks.mesh_throughput [--requests 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from benchmarks.engine_throughput import engine_generate
from services.client import VmeshClient
from services.common.grpc_server import channel
from services.common.model_loading import resolve_model_dir
from tests.support.mesh import start_mesh
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

WORKLOAD = Path(__file__).with_name("standard-64x128.json")
RESULTS = Path(__file__).with_name("results")
KV = "1GiB"


async def _stats(mesh):
    async with channel(mesh.services["scheduler"][0]) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        s = await stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest())
    async with channel(mesh.services["worker"][0]) as ch:
        w = await worker_pb2_grpc.WorkerServiceStub(ch).GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
    return s, w


async def _run_mesh(mesh, prompts: list[list[int]], max_tokens: int) -> dict:
    async with VmeshClient(mesh.address) as client:
        await client.complete(token_ids=prompts[0], max_tokens=4, temperature=0)  # warm-up
        s0, w0 = await _stats(mesh)
        started = time.perf_counter()
        results = await asyncio.gather(*(client.complete(token_ids=p, max_tokens=max_tokens, temperature=0,
                                                         ignore_eos=True) for p in prompts))
        elapsed = time.perf_counter() - started
        s1, w1 = await _stats(mesh)
    assert all(len(ids) == max_tokens for _t, ids, _l in results)
    decode_steps = s1.decode_steps - s0.decode_steps
    return {"tokens_per_s": len(prompts) * max_tokens / elapsed,
            "duty_cycle": (w1.busy_seconds - w0.busy_seconds) / (w1.wall_seconds - w0.wall_seconds),
            "bytes_per_decode_step": (s1.decode_plan_bytes - s0.decode_plan_bytes) / max(decode_steps, 1),
            "decode_steps": decode_steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    prompts = json.loads(WORKLOAD.read_text())["prompt_token_ids"][:args.requests]
    rows = {}
    for depth in (2, 1):
        for stateless in (False, True):
            name = f"depth{depth}-{'stateless' if stateless else 'stateful'}"
            flags = ["--pipeline-depth", str(depth), "--kv-cache-memory", KV] + (["--stateless-worker"] if stateless
                                                                                 else [])
            mesh = start_mesh(*flags)
            try:
                rows[name] = asyncio.run(_run_mesh(mesh, prompts, args.max_tokens))
            finally:
                mesh.stop()
            print(name, rows[name], flush=True)
    engine = engine_generate(resolve_model_dir(None), prompts, args.max_tokens, depth=2)
    best = rows["depth2-stateful"]
    print(f"\nin-process engine: {engine:.1f} tokens/s; mesh (depth 2, stateful): {best['tokens_per_s']:.1f} tokens/s "
          f"= {best['tokens_per_s'] / engine:.2f}x the engine")
    print(f"{'mode':>18} {'tok/s':>7} {'duty cycle':>11} {'bytes/decode step':>18}")
    for name, r in rows.items():
        print(f"{name:>18} {r['tokens_per_s']:>7.1f} {r['duty_cycle']:>11.3f} {r['bytes_per_decode_step']:>18.0f}")
    stateful, stateless = rows["depth2-stateful"], rows["depth2-stateless"]
    sync = rows["depth1-stateful"]
    print(f"stateless/stateful bytes per decode step: "
          f"{stateless['bytes_per_decode_step'] / stateful['bytes_per_decode_step']:.1f}x; "
          f"duty cycle depth 2 vs 1 (stateful): {stateful['duty_cycle']:.3f} vs {sync['duty_cycle']:.3f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mesh_throughput.json").write_text(json.dumps({"engine_tokens_per_s": engine, "modes": rows}, indent=1))


if __name__ == "__main__":
    main()
