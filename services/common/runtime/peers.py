"""The peers of a scaled tier as discovery reports them (the scheduler groups a frontend
submits to, the detokenizer replicas a frontend subscribes to, and those a scheduler streams
tokens to), and the one state every user keeps for each.

Each user keeps its own member objects (a connection, a subscription, a stream) and says how to
start one, when one is idle and how to let one go; the rules of joining and leaving are here,
once: an address that leaves is *retired* (no new work goes to it) and its member is let go
only when its last piece of work has ended, because that work is still streaming through it.
An address that comes back before then keeps its member, un-retired."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from vmesh.services.common.runtime.discovery import AddressBook, watch

logger = logging.getLogger(__name__)


class Member(Protocol):
    """What a PeerSet and the routing over it need of a member."""
    address: str
    retired: bool
    in_flight: int


@dataclass
class Peer:
    """One peer and the link to it, in the state every user of a tier tracks."""
    address: str
    alive: bool = False  # the link is up now (a stream is open, or the peer answered)
    draining: bool = False  # the peer says it takes no new work for now (shutting down, not serving)
    retired: bool = False  # its address left the list: no new work; let go once idle
    in_flight: int = 0  # work routed to it that has not ended
    # Set once start-up need not wait for it any more: the link came up, a first attempt
    # failed (trying goes on), or its address left the list.
    joined: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None  # what keeps the link open; cancelled when the peer is let go

    @property
    def ready(self) -> bool:
        """Up and taking new work (a retired peer may still be ready; it is just given none)."""
        return self.alive and not self.draining

    @property
    def routable(self) -> bool:
        return self.ready and not self.retired

    def stop(self) -> None:
        """Let the link go."""
        self.alive = False
        if self.task is not None:
            self.task.cancel()


M = TypeVar("M", bound=Member)


class PeerSet(Generic[M]):
    def __init__(self, kind: str, start: Callable[[str], M], is_idle: Callable[[M], bool],
                 stop: Callable[[M], None], on_retire: Callable[[M], None] = lambda member: None):
        """`kind` names the tier in logs. `start(address)` makes and starts a member;
        `is_idle(member)` says whether any work still depends on it; `stop(member)` lets it go.
        `on_retire(member)` runs when its address leaves, e.g. to stop waiting for it to join."""
        self.kind = kind
        self._start = start
        self._is_idle = is_idle
        self._stop = stop
        self._on_retire = on_retire
        self.members: dict[str, M] = {}

    def add(self, address: str) -> M:
        if (member := self.members.get(address)) is not None:  # it left and came back before it was idle
            member.retired = False
            return member
        member = self.members[address] = self._start(address)
        return member

    def remove(self, address: str) -> None:
        if (member := self.members.get(address)) is not None:
            member.retired = True
            self._on_retire(member)
            self.release_if_idle(member)

    def update(self, joined: list[str], left: list[str]) -> None:
        """Discovery's report of who joined and who left."""
        for address in joined:
            self.add(address)
        for address in left:
            self.remove(address)

    async def follow(self, book: AddressBook, interval_s: float) -> None:
        """Keep the members those of `book`, re-resolved every `interval_s`; until cancelled."""
        await watch(book, interval_s, self.update)

    def release_if_idle(self, member: M) -> bool:
        """Let a retired member go once nothing depends on it; call whenever its work may have
        ended. Returns whether it was let go."""
        if member.retired and self.members.get(member.address) is member and self._is_idle(member):
            del self.members[member.address]
            self._stop(member)
            logger.info("%s %s left", self.kind, member.address)
            return True
        return False

    def is_retired(self, address: str) -> bool:
        member = self.members.get(address)
        return member is not None and member.retired

    def active(self) -> list[M]:
        """Members that may take new work (whether each is ready for it is the user's business)."""
        return [m for m in self.members.values() if not m.retired]

    def get(self, address: str) -> M | None:
        return self.members.get(address)

    def __contains__(self, address: object) -> bool:
        return address in self.members

    def __iter__(self) -> Iterator[M]:
        return iter(list(self.members.values()))  # a copy: members may leave while the caller iterates

    def __len__(self) -> int:
        return len(self.members)
