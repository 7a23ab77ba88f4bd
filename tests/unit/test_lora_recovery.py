"""A worker that restarts keeps serving the group's LoRA adapters: the scheduler gives it back the
ones loaded at run time (and takes away start-up ones unloaded since) before any plan names them."""

from __future__ import annotations

import asyncio

import grpc

from tests.support.eventually import eventually
from tests.support.grpc_fakes import FakeContext, rpc_error
from tests.unit.test_scheduler_server import FakeWorker, Servicer, errors_sent, fail_stream, with_worker
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.scheduler.lora_admin import load_adapter, unload_adapter
from vmesh.v1 import common_pb2, scheduler_pb2


class AdapterWorker(FakeWorker):
    """A rank that holds LoRA adapters: after each (re)start only those of its --lora-modules."""

    def __init__(self, start_up: dict[str, str]):
        super().__init__()
        self.start_up = dict(start_up)
        self.held = dict(start_up)
        self.unreadable: set[str] = set()  # adapters whose files are gone
        # (adapter, plans on the newest stream when it was loaded): a load must come before any plan.
        self.loads: list[tuple[str, int]] = []

    def restart(self) -> None:
        self.down = True
        self.held = dict(self.start_up)

    async def GetWorkerInfo(self, request, **kwargs):
        info = await super().GetWorkerInfo(request)
        info.max_loras = 4
        info.lora_adapters[:] = list(self.held)
        info.lora_adapter_paths[:] = list(self.held.values())
        return info

    async def LoadLoraAdapter(self, request, timeout):
        if request.lora_name in self.unreadable:
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"no adapter_config.json in {request.lora_path}")
        self.held[request.lora_name] = request.lora_path
        self.loads.append((request.lora_name, len(self.streams[-1].plans) if self.streams else 0))
        return common_pb2.LoraAdapterResponse(lora_adapters=list(self.held))

    async def UnloadLoraAdapter(self, request, timeout):
        self.held.pop(request.lora_name, None)
        return common_pb2.LoraAdapterResponse(lora_adapters=list(self.held))


async def submit(servicer: Servicer, key: int, lora_name: str = "") -> None:
    await servicer.SubmitRequest(scheduler_pb2.SubmitRequestRequest(
        frontend_id="f", frontend_key=key, prompt_token_ids=[1, 2, 3], lora_name=lora_name), FakeContext())


async def restart_with_requests(worker: AdapterWorker, servicer: Servicer, adapters: list[str]) -> None:
    """Requests for `adapters` reach the worker; it restarts with them in flight and comes back."""
    for key, name in enumerate(adapters):
        await submit(servicer, key, name)
    await eventually(lambda: worker.streams[0].plans)
    worker.restart()
    await fail_stream(worker)
    await eventually(lambda: servicer.session.recovering)
    worker.down = False
    await eventually(lambda: len(worker.streams) == 2 and worker.streams[1].plans)


def test_a_restarted_worker_gets_the_run_time_adapters_back_before_its_first_plan():
    async def main() -> None:
        worker = AdapterWorker({"sql": "/adapters/sql", "chef": "/adapters/chef"})
        async with with_worker(worker, worker_retry=Backoff(0.01)) as servicer:
            await load_adapter(servicer.session, "poet", "/adapters/poet")
            await unload_adapter(servicer.session, "chef")  # a start-up adapter, unloaded at run time
            await restart_with_requests(worker, servicer, ["poet", "sql", ""])
            assert worker.held == {"sql": "/adapters/sql", "poet": "/adapters/poet"}
            assert worker.loads == [("poet", 0), ("poet", 0)]  # at run time, then on the new session's first plan
            replay = worker.streams[1].plans[0]
            assert [r.lora_name for r in replay.new_requests] == ["poet", "sql", ""]
            assert servicer.session.lora_adapters == {"sql": "/adapters/sql", "poet": "/adapters/poet"}
            assert not errors_sent(servicer) and servicer.session.failure is None

    asyncio.run(main())


def test_an_adapter_that_cannot_be_loaded_again_fails_only_its_requests():
    async def main() -> None:
        worker = AdapterWorker({"sql": "/adapters/sql"})
        async with with_worker(worker, worker_retry=Backoff(0.01)) as servicer:
            await load_adapter(servicer.session, "poet", "/adapters/poet")
            worker.unreadable.add("poet")  # its directory is gone by the time the worker restarts
            await restart_with_requests(worker, servicer, ["poet", "sql"])
            assert [r.lora_name for r in worker.streams[1].plans[0].new_requests] == ["sql"]
            (failed,) = errors_sent(servicer)
            assert failed.errors[0] == "LoRA adapter 'poet' could not be loaded again on this group"
            assert servicer.session.lora_adapters == worker.held == {"sql": "/adapters/sql"}

    asyncio.run(main())
