"""Memory under sustained load: `vmesh serve` (the embedded model) takes `--bursts` bursts of
`--streams` concurrent streamed requests, half over gRPC and half over HTTP, a tenth of each
burst cancelled early and another tenth given a short deadline; after each burst, once the
scheduler is idle, every service's PSS is recorded. Growth is measured from the first burst
(buffers sized once are then in place) to the last, and the largest PSS after the first.

    .venv/bin/python -m benchmarks.soak_memory [--bursts 30] [--streams 512] [--max-tokens 16] \\
        [--out benchmarks/results/soak_memory.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from vmesh.services.bench.memory import pss_mib
from vmesh.services.bench.mesh import RunningMesh, start_mesh
from vmesh.services.client import VmeshClient
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc


async def _grpc_stream(client: VmeshClient, i: int, max_tokens: int) -> None:
    timeout = 0.05 if i % 10 == 1 else None  # a tenth: a deadline that passes mid-request
    stream = client.generate(text=f"Tell me about the number {i}", max_tokens=max_tokens, ignore_eos=True,
                             timeout=timeout)
    try:
        async for _ in stream:
            if i % 10 == 0:  # a tenth: cancelled by the client after its first output
                break
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise


async def _http_stream(http: httpx.AsyncClient, i: int, max_tokens: int) -> None:
    body = {"prompt": f"Tell me about the number {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/completions", json=body) as response:
        assert response.status_code == 200, response.status_code
        async for _ in response.aiter_lines():
            if i % 10 == 0:
                break


async def _idle(mesh: RunningMesh) -> None:
    async with mesh.channel("scheduler") as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        while True:
            stats = await stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=10)
            if not (stats.num_running or stats.num_waiting or stats.num_used_blocks):
                return
            await asyncio.sleep(0.1)


async def _burst(mesh: RunningMesh, streams: int, max_tokens: int) -> None:
    async with VmeshClient(mesh.address) as client, httpx.AsyncClient(
            base_url=mesh.http_url, timeout=600, limits=httpx.Limits(max_connections=streams)) as http:
        await asyncio.gather(*(_grpc_stream(client, i, max_tokens) if i % 2 else _http_stream(http, i, max_tokens)
                               for i in range(streams)))
    await _idle(mesh)


def soak(bursts: int, streams: int, max_tokens: int) -> dict[str, Any]:
    mesh = start_mesh()
    try:
        pids = {name: pid for name, (_, pid) in mesh.services.items()}
        rounds = []
        for number in range(1, bursts + 1):
            started = time.monotonic()
            asyncio.run(_burst(mesh, streams, max_tokens))
            pss = {name: pss_mib(pid) for name, pid in pids.items()}
            rounds.append({"burst": number, "seconds": round(time.monotonic() - started, 2), "pss_mib": pss})
            print(f"burst {number}/{bursts}: {rounds[-1]['seconds']} s, PSS MiB {pss}", flush=True)
    finally:
        mesh.stop()
    first, last = rounds[0]["pss_mib"], rounds[-1]["pss_mib"]
    growth = {name: round(100 * (last[name] - first[name]) / first[name], 2)
              for name in first if first[name] and last[name] is not None}
    peak = {name: max(r["pss_mib"][name] for r in rounds[1:]) if bursts > 1 else first[name] for name in first}
    return {"bursts": bursts, "streams": streams, "max_tokens": max_tokens, "rounds": rounds,
            "growth_after_first_burst_percent": growth, "peak_after_first_burst_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", type=int, default=30)
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak_memory.json"))
    args = parser.parse_args()
    result = soak(args.bursts, args.streams, args.max_tokens)
    command = (f"python -m benchmarks.soak_memory --bursts {args.bursts} --streams {args.streams} "
               f"--max-tokens {args.max_tokens}")
    result["command"] = command
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"growth_after_first_burst_percent": result["growth_after_first_burst_percent"]}))


if __name__ == "__main__":
    main()
