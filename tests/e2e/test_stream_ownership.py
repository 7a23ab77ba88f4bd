"""Beyond the door: a plaintext mesh (`--no-internal-tls`), and a local process that is not part
of it playing the stranger who learned a frontend's id (here from the services' INFO logs). It
subscribes under that id, opens the worker's Execute stream, and claims request keys: each time
the rightful owner takes its stream back within seconds, and the clients' answers are exactly
those of an undisturbed mesh."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient, sampling_params
from vmesh.v1 import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc

PROMPT = "The three primary colors are"
ANSWER_TOKENS = 8
VICTIM_TOKENS = 48  # still generating while the stranger acts
TAKE_BACK_BOUND_S = 60.0  # only a bound on waiting for an ending that today's code never brings


@pytest.fixture(scope="module")
def plaintext_mesh():
    mesh = start_mesh("--no-internal-tls", log_level="INFO")
    line = mesh.wait_for_output(r"frontend frontend-[0-9a-f]+ subscribed")
    frontend_id = re.search(r"frontend (frontend-[0-9a-f]+) subscribed", line).group(1)  # type: ignore[union-attr]
    yield mesh, frontend_id
    mesh.stop()


async def _answer(client: VmeshClient, max_tokens: int = ANSWER_TOKENS) -> list[int]:
    _text, ids, _last = await client.complete(text=PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                              timeout=600)
    return ids


async def _ending(call) -> grpc.StatusCode | None:
    """How the stranger's stream ends: its status, or None when it never does (within the bound)."""
    async def drain() -> grpc.StatusCode:
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    try:
        return await asyncio.wait_for(drain(), TAKE_BACK_BOUND_S)
    except TimeoutError:
        call.cancel()
        return None


async def _victim(client: VmeshClient) -> tuple[asyncio.Task, str]:
    """A long request that is generating: its task (all its token ids) and its request id."""
    stream = client.generate(text=PROMPT, max_tokens=VICTIM_TOKENS, temperature=0, ignore_eos=True, timeout=600)
    first = await stream.__anext__()

    async def rest() -> list[int]:
        return list(first.token_ids) + [t async for out in stream for t in out.token_ids]

    return asyncio.ensure_future(rest()), first.request_id


def _run(mesh, main):
    """asyncio.run(main), with the mesh's last log lines when it fails (a race shows only there)."""
    try:
        return asyncio.run(main)
    except Exception as exc:
        raise AssertionError("the mesh's last output:\n" + "".join(mesh.output[-60:])) from exc


def test_a_frontend_takes_its_subscription_back_from_a_stranger(plaintext_mesh):
    mesh, frontend_id = plaintext_mesh

    async def main():
        async with VmeshClient(mesh.address) as client:
            undisturbed = await _answer(client, VICTIM_TOKENS)
            victim, _ = await _victim(client)
            async with grpc.aio.insecure_channel(mesh.services["detokenizer-0"][0]) as ch:
                call = detokenizer_pb2_grpc.DetokenizerServiceStub(ch).Subscribe(
                    detokenizer_pb2.SubscribeRequest(frontend_id=frontend_id))
                await call.initial_metadata()  # registered: the stranger holds the frontend's id
                ending = await _ending(call)
            return undisturbed, await victim, ending, await _answer(client)

    undisturbed, victim, ending, after = _run(mesh, main())
    assert ending == grpc.StatusCode.ABORTED, "the frontend never took its subscription back"
    assert victim == undisturbed  # failed over without a gap or a repeat
    assert after == undisturbed[:ANSWER_TOKENS]


def test_a_scheduler_takes_its_worker_back_from_a_stranger(plaintext_mesh):
    mesh, _ = plaintext_mesh

    async def main():
        async with VmeshClient(mesh.address) as client:
            undisturbed = await _answer(client, VICTIM_TOKENS)
            victim, _ = await _victim(client)
            async with grpc.aio.insecure_channel(mesh.services["worker"][0]) as ch:
                ending = await _ending(worker_pb2_grpc.WorkerServiceStub(ch).Execute())
            return undisturbed, await victim, ending, await _answer(client)

    undisturbed, victim, ending, after = _run(mesh, main())
    assert ending == grpc.StatusCode.ABORTED, "the scheduler never took its worker back"
    assert victim == undisturbed  # recomputed on the worker it took back
    assert after == undisturbed[:ANSWER_TOKENS]


def test_a_stranger_cannot_claim_a_frontend_s_request_keys(plaintext_mesh):
    mesh, frontend_id = plaintext_mesh

    async def main():
        async with VmeshClient(mesh.address) as client, \
                grpc.aio.insecure_channel(mesh.services["scheduler"][0]) as ch:
            scheduler = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            undisturbed = await _answer(client, VICTIM_TOKENS)
            victim, request_id = await _victim(client)  # a client sees its own key, as its request id

            async def claim(key: int) -> grpc.StatusCode:
                try:
                    await scheduler.SubmitRequest(scheduler_pb2.SubmitRequestRequest(
                        frontend_id=frontend_id, frontend_key=key, prompt_token_ids=[1, 2, 3],
                        sampling=sampling_params(max_tokens=200, ignore_eos=True)), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            taken = await claim(int(request_id))  # the victim's own key, while it runs
            following = [int(request_id) + n for n in range(1, 4)]  # the keys that would come next
            claims = [await claim(key) for key in following]
            answers = [await _answer(client) for _ in following]
            for key in following:
                await scheduler.AbortRequest(scheduler_pb2.AbortRequestRequest(frontend_id=frontend_id,
                                                                               frontend_key=key), timeout=10)
            return undisturbed, await victim, taken, claims, answers

    undisturbed, victim, taken, claims, answers = _run(mesh, main())
    assert taken == grpc.StatusCode.ALREADY_EXISTS
    assert victim == undisturbed  # the refused claim did not touch it
    assert claims == [grpc.StatusCode.OK] * 3  # a stranger can submit in plaintext, but the keys are not the next
    assert answers == [undisturbed[:ANSWER_TOKENS]] * 3
