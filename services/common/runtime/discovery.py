"""Replica discovery for a horizontally scaled tier (detokenizer replicas, scheduler groups).

An address spec is either `host:port` or `dns:///name:port`; the latter stands for every
address `name` resolves to (a Kubernetes headless Service, a docker-compose service with
replicas). Clients of a scaled tier re-resolve their specs periodically, so that a
scaled-out replica joins and a vanished one leaves without a restart."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from vmesh.services.common.config_flags import setting

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
DEFAULT_REFRESH_INTERVAL_S = 10.0


@dataclass(kw_only=True)
class DetokenizerReplicaSettings:
    """Where a service that dials the detokenizer tier (the scheduler, the frontend) finds its
    replicas, and how often it looks again."""
    detokenizer_addresses: list[str] = setting(
        [], section="detokenizer replicas",
        help="comma-separated host:port entries, or dns:///name:port for every address of name")
    replica_refresh_interval_s: float = setting(
        DEFAULT_REFRESH_INTERVAL_S, section="detokenizer replicas", flag="--replica-refresh-interval",
        help="seconds between re-resolutions of dns:/// entries, so scaled-out replicas join and vanished ones "
             "leave")


def resolve_spec(spec: str) -> list[str]:
    """The host:port addresses one spec stands for, sorted; raises OSError when a DNS name has none."""
    if not spec.startswith(DNS_PREFIX):
        return [spec]
    host, _, port = spec[len(DNS_PREFIX):].rpartition(":")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    ips = sorted({str(info[4][0]) for info in infos})
    if not ips:
        raise OSError(f"{spec} resolves to no address")
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


def expand_addresses(specs: list[str]) -> list[str]:
    """Every address the specs stand for, resolved once (a fixed group, such as worker ranks)."""
    return [address for spec in specs for address in resolve_spec(spec)]


class AddressBook:
    """The current addresses of a scaled tier. `refresh` re-resolves and reports who joined and
    who left. A spec that fails to resolve keeps its previous addresses: a DNS hiccup must not
    look like every replica leaving."""

    def __init__(self, specs: list[str], resolve: Callable[[str], list[str]] = resolve_spec):
        if not specs:
            raise ValueError("no replica addresses given")
        self.specs = list(specs)
        self._resolve = resolve
        self._by_spec = {spec: resolve(spec) for spec in self.specs}  # the first resolution must succeed

    @property
    def addresses(self) -> list[str]:
        return sorted({a for addresses in self._by_spec.values() for a in addresses})

    @property
    def dynamic(self) -> bool:
        """Whether re-resolving can ever change anything."""
        return any(spec.startswith(DNS_PREFIX) for spec in self.specs)

    def refresh(self) -> tuple[list[str], list[str]]:
        """Re-resolve every spec; returns (joined, left) addresses."""
        before = set(self.addresses)
        for spec in self.specs:
            try:
                self._by_spec[spec] = self._resolve(spec)
            except OSError as exc:
                logger.warning("re-resolving %s failed (%s); keeping its %d known address(es)", spec, exc,
                               len(self._by_spec[spec]))
        after = set(self.addresses)
        return sorted(after - before), sorted(before - after)


async def watch(book: AddressBook, interval_s: float, on_change: Callable[[list[str], list[str]], None]) -> None:
    """Re-resolve `book` every `interval_s` and call on_change(joined, left) when it changed.
    Runs until cancelled; returns at once for a list that can never change."""
    if not book.dynamic:
        return
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        joined, left = await loop.run_in_executor(None, book.refresh)  # getaddrinfo blocks
        if joined or left:
            logger.info("replicas joined: %s; left: %s", joined or "-", left or "-")
            on_change(joined, left)
