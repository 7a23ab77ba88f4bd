"""The mesh with every door locked: mutual TLS between services from a private CA (`vmesh serve`'s
default), TLS and an API key on the public gRPC port and the HTTP API. Forged internal calls are
refused, and a victim's request runs to its end untouched."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import grpc
import httpx
import pytest

from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient
from vmesh.services.common import tls
from vmesh.services.common.certs import issue_role, make_ca, write_mesh_certificates
from vmesh.services.common.grpc_server import channel
from vmesh.v1 import (
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2_grpc,
)

API_KEY = "test-key-7f3a"
VICTIM_TOKENS = 200  # long enough to still be generating when every attack has been tried


@pytest.fixture(scope="module")
def secure_mesh(tmp_path_factory):
    public = write_mesh_certificates(tmp_path_factory.mktemp("public"), roles=(),
                                     public_hosts=["127.0.0.1", "localhost"])
    mesh = start_mesh("--public-tls-cert", str(public / "public.crt"),
                      "--public-tls-key", str(public / "public.key"), "--api-key", API_KEY)
    yield mesh, public / "ca.crt"
    mesh.stop()


def _identity(certificates: str, role: str) -> tls.Identity:
    d = Path(certificates)
    return tls.Identity.from_files(d / f"{role}.crt", d / f"{role}.key", d / "ca.crt")


def _channel(address: str, caller: tls.Identity | None, peer: str) -> grpc.aio.Channel:
    return channel(address, peer, secure=caller is not None, identity=caller)


def _forger(certificates: str) -> tls.Identity:
    """A frontend certificate from a CA the mesh never trusted."""
    ca_cert, ca_key = make_ca()
    cert, key = issue_role(ca_cert, ca_key, "frontend")
    return tls.Identity("frontend", cert, key, _identity(certificates, "admin").ca)


async def _code(coro) -> grpc.StatusCode:
    try:
        result = coro()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_public_grpc_needs_tls_and_the_key(secure_mesh):
    mesh, ca = secure_mesh

    async def main():
        async with VmeshClient(mesh.address, api_key=API_KEY, tls_ca=str(ca)) as client:
            _text, ids, _ = await client.complete(text="Say yes.", max_tokens=3, temperature=0)
        async with VmeshClient(mesh.address, tls_ca=str(ca)) as client:
            no_key = await _code(lambda: client.complete(text="hi", max_tokens=1))
        async with VmeshClient(mesh.address, api_key="wrong", tls_ca=str(ca)) as client:
            wrong_key = await _code(lambda: client.complete(text="hi", max_tokens=1))
        async with VmeshClient(mesh.address, api_key=API_KEY) as client:  # plaintext to a TLS port
            plaintext = await _code(lambda: client.complete(text="hi", max_tokens=1, timeout=10))
        return ids, no_key, wrong_key, plaintext

    ids, no_key, wrong_key, plaintext = asyncio.run(main())
    assert len(ids) == 3
    assert no_key == wrong_key == grpc.StatusCode.UNAUTHENTICATED
    assert plaintext == grpc.StatusCode.UNAVAILABLE
    frontend_argv = Path(f"/proc/{mesh.services['frontend'][1]}/cmdline").read_bytes()
    assert API_KEY.encode() not in frontend_argv, "the key reaches the frontend by environment, not argv"


def test_http_api_needs_tls_and_the_key(secure_mesh):
    mesh, ca = secure_mesh
    assert mesh.http_url.startswith("https://")
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=30) as http:
        assert http.get(f"{mesh.http_url}/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert http.get(f"{mesh.http_url}/models").status_code == 401
        assert http.get(f"{mesh.http_url}/models", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_forged_internal_calls_cannot_touch_a_running_request(secure_mesh):
    mesh, ca = secure_mesh
    scheduler, worker = mesh.services["scheduler"][0], mesh.services["worker"][0]
    detokenizer = mesh.services["detokenizer-0"][0]
    admin, forger = _identity(mesh.certificates, "admin"), _forger(mesh.certificates)

    async def attack() -> dict[str, grpc.StatusCode]:
        codes = {}
        abort = scheduler_pb2.AbortRequestRequest(frontend_id="any", frontend_key=1)
        for name, caller in [("plaintext", None), ("foreign-ca", forger), ("admin", admin)]:
            async with _channel(scheduler, caller, "scheduler") as ch:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
                codes[f"abort/{name}"] = await _code(lambda s=stub: s.AbortRequest(abort, timeout=10))
                codes[f"submit/{name}"] = await _code(lambda s=stub: s.SubmitRequest(
                    scheduler_pb2.SubmitRequestRequest(frontend_key=7, frontend_id="any", prompt_token_ids=[1]),
                    timeout=10))
            async with _channel(detokenizer, caller, "detokenizer") as ch:
                stub = detokenizer_pb2_grpc.DetokenizerServiceStub(ch)
                codes[f"subscribe/{name}"] = await _code(lambda s=stub: s.Subscribe(
                    detokenizer_pb2.SubscribeRequest(frontend_id="any"), timeout=3))
                # Streams opened and never written: a write or half-close racing the refusal would
                # turn its code into INTERNAL on the client (grpc/grpc#36066); roles are checked on opening.
                codes[f"inject/{name}"] = await _code(lambda s=stub: s.Detokenize(timeout=3))
            async with _channel(worker, caller, "worker") as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                codes[f"execute/{name}"] = await _code(lambda s=stub: s.Execute(timeout=3))
        async with _channel(scheduler, admin, "scheduler") as ch:  # operators may read stats
            stats = await scheduler_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStats(
                scheduler_pb2.GetSchedulerStatsRequest(), timeout=10)
            codes["stats/admin"] = grpc.StatusCode.OK if stats.num_blocks else grpc.StatusCode.UNKNOWN
            # the attacks all ran while the victim was still generating
            codes["running-during-attack"] = grpc.StatusCode.OK if stats.num_running else grpc.StatusCode.UNKNOWN
        return codes

    async def main():
        async with VmeshClient(mesh.address, api_key=API_KEY, tls_ca=str(ca)) as client:
            stream = client.generate(text="Tell me a story.", max_tokens=VICTIM_TOKENS, ignore_eos=True,
                                     temperature=0)
            first = await stream.__anext__()  # the victim's request is running
            codes = await attack()
            ids = list(first.token_ids)
            async for out in stream:
                ids += out.token_ids
                last = out
            assert codes.pop("running-during-attack") is grpc.StatusCode.OK
        return codes, ids, last

    codes, ids, last = asyncio.run(main())
    refused = {grpc.StatusCode.UNAVAILABLE}
    for name in ("plaintext", "foreign-ca"):
        for call in ("abort", "submit", "subscribe", "inject", "execute"):
            assert codes[f"{call}/{name}"] in refused, (call, name, codes)
    for call in ("abort", "submit", "subscribe", "inject", "execute"):
        assert codes[f"{call}/admin"] == grpc.StatusCode.PERMISSION_DENIED, (call, codes)
    assert codes["stats/admin"] == grpc.StatusCode.OK
    assert len(ids) == VICTIM_TOKENS and last.usage.completion_tokens == VICTIM_TOKENS  # untouched
