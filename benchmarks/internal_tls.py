"""What internal mutual TLS costs per step: one decode step's plan down a WorkerService.Execute
stream and its result back, over loopback through the services' own server shell and channels,
with `vmesh serve`'s default (mutual TLS, certificates from a fresh CA) and with
`--no-internal-tls` (plaintext), in alternated rounds. Microseconds per round trip, medians.

    .venv/bin/python -m benchmarks.internal_tls [--batch 64] [--steps 2000] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from vmesh.services.common import tls
from vmesh.services.common.certs import write_mesh_certificates
from vmesh.services.common.grpc_server import ServiceShell, channel
from vmesh.services.common.server_settings import ServerSettings
from vmesh.services.common.step_types import StepPlan, StepResult
from vmesh.services.common.wire.step import plan_to_proto, result_to_proto
from vmesh.v1 import worker_pb2, worker_pb2_grpc


class EchoWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Answers every plan with the same result at once: only the link is measured."""

    def __init__(self, result: worker_pb2.ExecuteResponse):
        self.result = result

    async def Execute(self, request_iterator, context):
        async for _ in request_iterator:
            yield self.result


async def round_trip_us(server: tls.Identity | None, client: tls.Identity | None, batch: int, steps: int) -> float:
    shell = ServiceShell("worker", worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
                         ServerSettings(identity=server))
    handles = list(range(batch))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        EchoWorker(result_to_proto(StepResult(step=0, handles=handles, sampled_token_ids=[7] * batch))), shell.server)
    await shell.server.start()
    plan = plan_to_proto(StepPlan(0, scheduled_handles=handles, num_scheduled_tokens=[1] * batch))
    try:
        async with channel(shell.address, "worker", identity=client) as ch:
            call = worker_pb2_grpc.WorkerServiceStub(ch).Execute()
            for _ in range(50):  # the handshake and warm-up stay out of the figure
                await call.write(plan)
                await call.read()
            started = time.perf_counter()
            for _ in range(steps):
                await call.write(plan)
                await call.read()
            elapsed = time.perf_counter() - started
            await call.done_writing()
        return elapsed / steps * 1e6
    finally:
        await shell.server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64, help="requests in the decode step")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        certs = write_mesh_certificates(Path(tmp))

        def identity(role: str) -> tls.Identity:
            return tls.Identity.from_files(certs / f"{role}.crt", certs / f"{role}.key", certs / "ca.crt")

        modes = {"mutual TLS": (identity("worker"), identity("scheduler")), "plaintext": (None, None)}
        rounds: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode, (server, client) in modes.items():
                rounds[mode].append(asyncio.run(round_trip_us(server, client, args.batch, args.steps)))
    for mode, values in rounds.items():
        print(f"{mode:>10}: {statistics.median(values):7.1f} us per step round trip (rounds: "
              + ", ".join(f"{v:.1f}" for v in values) + ")")
    cost = statistics.median(rounds["mutual TLS"]) - statistics.median(rounds["plaintext"])
    print(f"mutual TLS costs {cost:.1f} us per step on this link (batch {args.batch})")


if __name__ == "__main__":
    main()
