"""`vmesh serve`'s own settings: how many of each service it starts, and how it runs them. The
launcher reads them (services/launcher.py); no service is given them."""

from __future__ import annotations

from dataclasses import dataclass

from vmesh.services.common.config_flags import setting


@dataclass(frozen=True)
class MeshSettings:
    detokenizers: int = setting(1, section="mesh", help="detokenizer replicas")
    data_parallel_size: int = setting(
        1, section="mesh",
        help="worker groups, each a worker and its scheduler; the frontend spreads requests over them")
    metrics: bool = setting(False, section="mesh", help="every service serves Prometheus metrics on a free port")
    fail_fast: bool = setting(
        False, section="mesh",
        help="stop the whole mesh when any service dies (default: restart it in place, with backoff; its requests "
             "fail over)")
    internal_tls: bool = setting(
        False, section="mesh",
        help="mutual TLS between the services, from a private CA made for this run (its admin certificate is "
             "printed, for operator tools)")
