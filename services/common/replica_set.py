"""Membership of a scaled tier as discovery reports it: the scheduler groups a frontend submits
to, the detokenizer replicas a frontend subscribes to, and those a scheduler streams tokens to.

Each user keeps its own member objects (a connection, a subscription, a stream) and says how to
start one, when one is idle and how to let one go; the rules of joining and leaving are here,
once: an address that leaves is *retired* (no new work goes to it) and its member is let go
only when its last piece of work has ended, because that work is still streaming through it.
An address that comes back before then keeps its member, un-retired."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)


class Member(Protocol):
    address: str
    retired: bool


M = TypeVar("M", bound=Member)


class ReplicaSet(Generic[M]):
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
        """The discovery watch's callback (`services.common.discovery.watch`)."""
        for address in joined:
            self.add(address)
        for address in left:
            self.remove(address)

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
