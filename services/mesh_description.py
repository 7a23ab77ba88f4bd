"""What a running `vmesh serve` is made of, as the launcher writes it beside its ready file
(`<ready-file>.mesh.json`) and as `start_mesh` reads it: one definition of the launcher's
answer, so nothing parses its printed lines."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vmesh.services.common import tls
from vmesh.services.common.runtime.readiness import Announcement, ReadyFiles

ADMIN_ROLE = "admin"


@dataclass
class ServiceEntry:
    address: str
    pid: int
    metrics_url: str = ""  # http://host:port/metrics, when the service serves metrics
    restarts: int = 0  # times the launcher restarted it after it died


@dataclass
class FrontendEntry:
    address: str  # its public gRPC address
    http_url: str = ""  # its OpenAI-compatible API's base URL (…/v1), "" when off


@dataclass
class MeshDescription:
    address: str  # the frontend's public gRPC address
    http_url: str = ""  # the OpenAI-compatible API's base URL (…/v1), "" when off
    # The directory of the run's CA and admin certificate; "" with --no-internal-tls.
    certificates: str = ""
    services: dict[str, ServiceEntry] = field(default_factory=dict)  # worker, scheduler, detokenizer-0, …
    frontends: list[FrontendEntry] = field(default_factory=list)  # every frontend, the one above first

    def admin_identity(self) -> tls.Identity | None:
        """The run's admin identity (what operator tools present to the internal services);
        None when the services talk plaintext."""
        if not self.certificates:
            return None
        d = Path(self.certificates)
        return tls.Identity.from_files(d / f"{ADMIN_ROLE}.crt", d / f"{ADMIN_ROLE}.key", d / "ca.crt")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> MeshDescription:
        raw = json.loads(text)
        services = {name: ServiceEntry(**entry) for name, entry in raw.pop("services").items()}
        frontends = [FrontendEntry(**entry) for entry in raw.pop("frontends", [])]
        return cls(**raw, services=services, frontends=frontends)


def role_of_service(name: str) -> str:
    """The role of a service the launcher named (worker, worker-1, worker-rank0, detokenizer-0, ...)."""
    return name.split("-", 1)[0]


def description_path(ready_file: str | Path) -> Path:
    return ReadyFiles(ready_file).file(Announcement.MESH_DESCRIPTION)
