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
from vmesh.services.common.types import (
    PROMPT_TAIL_TOKENS,
    FinishReason,
    RequestRef,
    SamplingParams,
    StepTokens,
    StreamStart,
    TokenBatch,
)


async def _detokenizer_throughput(replicas: int, prompts: list[list[int]], max_tokens: int) -> float:
    """Push one engine step of token ids at a time through `replicas` detokenizer processes,
    requests spread evenly, and count the tokens a subscribed frontend receives."""
    import subprocess
    import sys

    from vmesh.services.common.grpc_server import wait_until_serving
    from vmesh.services.common.wire import tokens
    from vmesh.v1 import detokenizer_pb2, detokenizer_pb2_grpc

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
            params = SamplingParams(max_tokens=max_tokens)
            started = time.perf_counter()
            for step in range(max_tokens):
                for r, call in enumerate(calls):
                    mine = range(r, len(prompts), replicas)
                    last = step == max_tokens - 1
                    batch = TokenBatch(
                        [StreamStart(RequestRef("bench", h), prompts[h][-PROMPT_TAIL_TOKENS:], params, len(prompts[h]),
                                     handle=h) for h in mine] if step == 0 else [],
                        [StepTokens(h, [prompts[h][(step * 7) % len(prompts[h])]],
                                    FinishReason.LENGTH if last else None) for h in mine])
                    await call.write(tokens.to_proto(batch))
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
