"""The security matrix of the internal services: mutual TLS from the mesh CA, and each method
callable only by the roles that should call it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from vmesh.services.common import tls
from vmesh.services.common.certs import issue_role, make_ca, write_mesh_certificates
from vmesh.services.common.grpc_server import ServiceShell, channel
from vmesh.services.common.server_settings import ServerSettings
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc


class StubScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    async def SubmitRequest(self, request, context):
        return scheduler_pb2.SubmitRequestResponse(detokenizer="d")

    async def ResetPrefixCache(self, request, context):
        return scheduler_pb2.ResetPrefixCacheResponse()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return write_mesh_certificates(tmp_path_factory.mktemp("certs"))


def identity(certs: Path, role: str) -> tls.Identity:
    return tls.Identity.from_files(certs / f"{role}.crt", certs / f"{role}.key", certs / "ca.crt")


def client_channel(address: str, caller: tls.Identity | None, peer: str = "scheduler", ca: bytes | None = None):
    if caller is None:
        if ca is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca), options=[
            ("grpc.ssl_target_name_override", tls.role_dns_name(peer))])
    return channel(address, peer, identity=caller)


async def call(server_identity: tls.Identity, make_channel, method: str = "SubmitRequest") -> grpc.StatusCode:
    shell = ServiceShell("scheduler", scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
                         ServerSettings(identity=server_identity))
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(StubScheduler(), shell.server)
    await shell.server.start()
    try:
        async with make_channel(shell.address) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            request = (scheduler_pb2.ResetPrefixCacheRequest() if method == "ResetPrefixCache"
                       else scheduler_pb2.WatchCacheRequest() if method == "WatchCache"
                       else scheduler_pb2.SubmitRequestRequest(frontend_key=1))
            try:
                if method == "WatchCache":  # a stream: its first message, or its refusal
                    await getattr(stub, method)(request, timeout=10).read()
                else:
                    await getattr(stub, method)(request, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK
    finally:
        await shell.server.stop(None)


MATRIX = [
    # (caller role or special, method, expected)
    ("frontend", "SubmitRequest", grpc.StatusCode.OK),
    ("admin", "ResetPrefixCache", grpc.StatusCode.OK),
    ("worker", "SubmitRequest", grpc.StatusCode.PERMISSION_DENIED),
    ("detokenizer", "SubmitRequest", grpc.StatusCode.PERMISSION_DENIED),
    ("frontend", "ResetPrefixCache", grpc.StatusCode.PERMISSION_DENIED),
    ("admin", "SubmitRequest", grpc.StatusCode.PERMISSION_DENIED),
    ("worker", "WatchCache", grpc.StatusCode.PERMISSION_DENIED),  # the cache's hashes are the frontends' alone
    ("detokenizer", "WatchCache", grpc.StatusCode.PERMISSION_DENIED),
]


@pytest.mark.parametrize(("role", "method", "expected"), MATRIX, ids=[f"{r}-{m}" for r, m, _ in MATRIX])
def test_each_method_answers_only_its_roles(certs, role, method, expected):
    code = asyncio.run(call(identity(certs, "scheduler"),
                            lambda address: client_channel(address, identity(certs, role)), method))
    assert code == expected


def test_no_certificate_is_refused(certs):
    """Plaintext, and TLS without a client certificate, never reach a servicer."""
    server = identity(certs, "scheduler")
    assert asyncio.run(call(server, lambda a: client_channel(a, None))) == grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(call(server, lambda a: client_channel(a, None, ca=server.ca))) == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_from_another_ca_is_refused(certs):
    ca_cert, ca_key = make_ca()
    cert, key = issue_role(ca_cert, ca_key, "frontend")
    forged = tls.Identity("frontend", cert, key, identity(certs, "frontend").ca)
    code = asyncio.run(call(identity(certs, "scheduler"), lambda a: client_channel(a, forged)))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_a_client_refuses_a_server_of_the_wrong_role(certs):
    """A frontend that expects a scheduler does not talk to a worker's certificate there."""
    code = asyncio.run(call(identity(certs, "worker"),
                            lambda a: client_channel(a, identity(certs, "frontend"), peer="scheduler")))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_role_comes_from_the_certificate(certs):
    assert identity(certs, "worker").role == "worker"
    ca_cert, ca_key = make_ca()
    from vmesh.services.common.certs import issue

    cert, _ = issue(ca_cert, ca_key, "intruder", ["intruder.vmesh.internal"])
    with pytest.raises(ValueError, match="not a vmesh role"):
        tls.role_of_certificate(cert)


def test_keys_are_private(certs):
    assert (certs / "frontend.key").stat().st_mode & 0o077 == 0
    assert (certs / "ca.crt").stat().st_mode & 0o044 == 0o044


def test_a_role_name_without_the_role_dns_name_is_no_role():
    """The common name alone does not make a role: the certificate must be issued as the role."""
    from vmesh.services.common.certs import issue

    ca_cert, ca_key = make_ca()
    server_cert, server_key = issue_role(ca_cert, ca_key, "scheduler")
    forged_cert, forged_key = issue(ca_cert, ca_key, "frontend", ["evil.example"])
    server = tls.Identity("scheduler", server_cert, server_key, ca_cert)
    forged = tls.Identity("frontend", forged_cert, forged_key, ca_cert)
    assert asyncio.run(call(server, lambda a: client_channel(a, forged))) == grpc.StatusCode.UNAUTHENTICATED


def test_the_public_certificate_is_no_client_of_the_mesh(tmp_path):
    directory = write_mesh_certificates(tmp_path / "m", public_hosts=["api.example.com", "127.0.0.1"])
    server = tls.Identity.from_files(directory / "scheduler.crt", directory / "scheduler.key", directory / "ca.crt")
    public = tls.Identity("frontend", (directory / "public.crt").read_bytes(), (directory / "public.key").read_bytes(),
                          (directory / "ca.crt").read_bytes())
    code = asyncio.run(call(server, lambda a: client_channel(a, public)))
    assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    with pytest.raises(ValueError, match="named like a role"):
        write_mesh_certificates(tmp_path / "n", public_hosts=["frontend"])


def test_certificates_pass_strict_x509_verification(tmp_path):
    """Python >= 3.13 clients (httpx, openai) verify with VERIFY_X509_STRICT, which wants key
    identifiers; a TLS handshake in memory under that flag must succeed."""
    import ssl

    directory = write_mesh_certificates(tmp_path / "m", roles=(), public_hosts=["localhost"])
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(directory / "public.crt", directory / "public.key")
    client_ctx = ssl.create_default_context(cafile=str(directory / "ca.crt"))
    client_ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(to_client, to_server, server_hostname="localhost")
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side in (("client", client), ("server", server)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(to_server.read())
        to_client.write(s_out.read())
        if all(done.values()):
            break
    assert all(done.values())


def test_serve_runs_internal_mutual_tls_unless_told_not_to(monkeypatch):
    from vmesh.services.cli import build_parser
    from vmesh.services.mesh_settings import mesh_settings

    def internal_tls(*argv: str) -> bool:
        return mesh_settings(build_parser().parse_args(["serve", *argv])).internal_tls

    assert internal_tls() is True
    assert internal_tls("--no-internal-tls") is False
    monkeypatch.setenv("VMESH_NO_INTERNAL_TLS", "1")
    assert internal_tls() is False
