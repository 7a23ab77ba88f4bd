"""How one service process listens and who it is: its address, ready file and metrics port
(the "server" flags), its mutual-TLS identity, plaintext health port and reflection (the
"security" flags). Built once from the command line (`ServerSettings.from_args`) and passed
whole to the service's serve() and from there to its ServiceShell and its channels; nothing
about it is kept in a module.

This module stays free of gRPC (the identity's certificates are read through tls only when
given), so that building the command line imports no more than the settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from vmesh.services.common.config_flags import setting, values_from_args

if TYPE_CHECKING:
    from vmesh.services.common.tls import Identity

# What one client message may hold on the public port: prompts are capped far below the
# internal 64 MiB, and a message is parsed (and copied) before any check can see it.
DEFAULT_PUBLIC_MAX_MESSAGE_BYTES = 8 << 20


@dataclass(frozen=True)
class PublicPort:
    """The frontend's port for clients: TLS without client certificates when a certificate is
    given (the API key proves the caller), and a message cap of its own."""
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_bytes: int = DEFAULT_PUBLIC_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--public-tls-cert and --public-tls-key go together")

    @classmethod
    def for_prompts(cls, tls_cert: str | None, tls_key: str | None, max_prompt_bytes: int) -> PublicPort:
        """Room for the largest prompt admitted, twice over (its message carries more than the text)."""
        return cls(tls_cert or None, tls_key or None, max(DEFAULT_PUBLIC_MAX_MESSAGE_BYTES, 2 * max_prompt_bytes))


@dataclass(frozen=True)
class ServerSettings:
    host: str = setting("127.0.0.1", section="server")
    port: int = setting(0, section="server", help="0: any free port")
    ready_file: str | None = setting(None, section="server", help="write the bound address here once listening")
    metrics_port: int | None = setting(
        None, section="server", parse_flag=int,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; default: off)")
    tls_cert: str | None = setting(
        None, section="security",
        help="mutual TLS between services: this service's certificate from the mesh CA, its common name its role "
             "(vmesh certs writes them); with --tls-key and --tls-ca")
    tls_key: str | None = setting(None, section="security", help="the certificate's private key")
    tls_ca: str | None = setting(
        None, section="security", help="the mesh CA: the only issuer trusted for calls between services")
    health_port: int | None = setting(
        None, section="security", parse_flag=int,
        help="also serve the gRPC health service alone, in plaintext, on this port (for probes that cannot present "
             "a certificate, such as Kubernetes' gRPC probes; 0: any free port)")
    reflection: bool = setting(False, section="security",
                               help="serve gRPC reflection (with mutual TLS: to the admin role)")
    # The certificate, key and CA read from the three files: with it, every server of this
    # process requires mutual TLS and checks roles, and every channel it opens presents it.
    identity: Identity | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str | None) -> ServerSettings:
        """The settings a command's flags give, its identity read and checked. `role`: the role
        the certificate must carry (None: any, as for `vmesh health`)."""
        return cls(**values_from_args(cls, args)).with_identity(role)

    def with_identity(self, role: str | None) -> ServerSettings:
        files = [self.tls_cert, self.tls_key, self.tls_ca]
        if not any(files):
            return self
        if not all(files):
            raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
        from vmesh.services.common.tls import Identity  # gRPC, only for a process that uses TLS

        identity = Identity.from_files(*(str(f) for f in files))
        if role is not None and identity.role != role:
            raise ValueError(f"--tls-cert is a {identity.role} certificate; this is the {role}")
        return replace(self, identity=identity)
