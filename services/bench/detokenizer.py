"""`vmesh bench detokenizer`: tokens per second through detokenizer replicas alone."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from vmesh.services.bench.common import load_workload, machine
from vmesh.services.common.grpc_server import channel
from vmesh.services.common.types import SamplingParams


async def _detokenizer_throughput(replicas: int, prompts: list[list[int]], max_tokens: int) -> float:
    """Push one engine step of token ids at a time through `replicas` detokenizer processes,
    requests spread evenly, and count the tokens a subscribed frontend receives."""
    import subprocess
    import sys

    from vmesh.services.common.grpc_server import wait_until_serving
    from vmesh.services.common.wire.sampling import sampling_to_proto
    from vmesh.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc

    with tempfile.TemporaryDirectory() as tmp:
        procs, addresses = [], []
        for i in range(replicas):
            ready = Path(tmp) / f"d{i}"
            procs.append(subprocess.Popen([sys.executable, "-m", "vmesh", "--log-level", "WARNING",
                                           "detokenizer", "--port", "0", "--ready-file", str(ready)]))
            while not ready.exists():
                await asyncio.sleep(0.05)
            addresses.append(ready.read_text())
        try:
            for a in addresses:
                await wait_until_serving(a, 120)
            channels = [channel(a, "detokenizer") for a in addresses]
            stubs = [detokenizer_pb2_grpc.DetokenizerServiceStub(c) for c in channels]
            subs = [s.Subscribe(detokenizer_pb2.SubscribeRequest(frontend_id="bench")) for s in stubs]
            for sub in subs:
                await sub.initial_metadata()
            total = len(prompts) * max_tokens
            received = 0
            done = asyncio.Event()

            async def drain(sub) -> None:
                nonlocal received
                async for batch in sub:
                    received += sum(batch.num_tokens)
                    if received >= total:
                        done.set()

            readers = [asyncio.create_task(drain(s)) for s in subs]
            calls = [s.Detokenize() for s in stubs]
            params = sampling_to_proto(SamplingParams(max_tokens=max_tokens))
            started = time.perf_counter()
            for step in range(max_tokens):
                for r, call in enumerate(calls):
                    mine = range(r, len(prompts), replicas)
                    batch = detokenizer_pb2.DetokenizeRequest()
                    if step == 0:
                        batch.new_requests.extend(detokenizer_pb2.DetokenizerRequestInfo(
                            handle=h, frontend_id="bench", frontend_key=h, prompt_tail=prompts[h][-4:],
                            sampling=params, num_prompt_tokens=len(prompts[h])) for h in mine)
                    for h in mine:
                        batch.handles.append(h)
                        batch.num_tokens.append(1)
                        batch.token_ids.append(prompts[h][(step * 7) % len(prompts[h])])
                        last = step == max_tokens - 1
                        batch.finish_reasons.append(common_pb2.FINISH_REASON_LENGTH if last else 0)
                        batch.num_cached_prompt_tokens.append(0)
                        batch.errors.append("")
                    await call.write(batch)
            await asyncio.wait_for(done.wait(), 600)
            elapsed = time.perf_counter() - started
            for task in readers:
                task.cancel()
            for call in calls:
                call.cancel()
            for c in channels:
                await c.close()
            return total / elapsed
        finally:
            for p in procs:
                p.terminate()
                p.wait()


def detokenizer(args: argparse.Namespace) -> dict[str, Any]:
    work = load_workload(args.workload, args.requests, args.max_tokens)
    result = {"mode": "detokenizer", **machine(), "tokens_per_s": {}}
    for replicas in args.replicas:
        tps = asyncio.run(_detokenizer_throughput(replicas, work["prompts"], work["max_tokens"]))
        result["tokens_per_s"][str(replicas)] = tps
        print(f"{replicas} detokenizer replica(s): {tps:.0f} tokens/s")
    return result
