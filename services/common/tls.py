"""Mutual TLS between vmesh services, and the roles it proves.

Every process has at most one identity (ServerSettings.identity, passed to its servers and
channels): a certificate from the mesh's private CA whose common name is its role (frontend,
scheduler, worker, detokenizer or admin) and whose only DNS name is `<role>.vmesh.internal`.
A client dialling a peer checks the peer's certificate against the role it expects (gRPC's
target-name check, pointed at that DNS name), and a server learns the caller's role from its
client certificate, which ServerGuard (services/common/guards.py) checks against the methods
that role may call. Addresses play no part, so the same certificates work
on loopback, in compose and in Kubernetes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from vmesh.services.common.types import ROLES

INTERNAL_DOMAIN = "vmesh.internal"


def role_dns_name(role: str) -> str:
    return f"{role}.{INTERNAL_DOMAIN}"


@dataclass(frozen=True)
class Identity:
    role: str
    cert: bytes  # PEM
    key: bytes  # PEM
    ca: bytes  # PEM: the mesh's CA, the only one trusted for internal calls

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, ca: str | Path) -> Identity:
        cert_pem = Path(cert).read_bytes()
        return cls(role_of_certificate(cert_pem), cert_pem, Path(key).read_bytes(), Path(ca).read_bytes())


def role_of_certificate(cert_pem: bytes) -> str:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    names = x509.load_pem_x509_certificate(cert_pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    role = str(names[0].value) if names else ""
    if role not in ROLES:
        raise ValueError(f"certificate common name {role!r} is not a vmesh role ({', '.join(ROLES)})")
    return role


def server_credentials(identity: Identity) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(identity.key, identity.cert)], root_certificates=identity.ca,
                                       require_client_auth=True)


def public_server_credentials(cert: str | Path, key: str | Path) -> grpc.ServerCredentials:
    """TLS for the frontend's public port: clients prove nothing here (the API key does that)."""
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


def channel_security(identity: Identity, peer_role: str) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
    """Credentials presenting `identity`, and the option that makes gRPC accept only a server
    certificate issued for `peer_role`."""
    credentials = grpc.ssl_channel_credentials(root_certificates=identity.ca, private_key=identity.key,
                                               certificate_chain=identity.cert)
    return credentials, [("grpc.ssl_target_name_override", role_dns_name(peer_role))]


def caller_role(context: grpc.aio.ServicerContext) -> str | None:
    """The role in the caller's verified client certificate: its common name, when its DNS name
    is that role's too (as `vmesh certs` issues them); None otherwise."""
    auth = context.auth_context()
    names = auth.get("x509_common_name") or []
    role = names[0].decode() if names else None
    if role not in ROLES:
        return None
    alt_names = {n.decode() for n in auth.get("x509_subject_alternative_name") or []}
    return role if role_dns_name(role) in alt_names else None
