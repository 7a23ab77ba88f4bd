"""PeerSet: the one definition of joining, leaving, and retiring once idle."""
from __future__ import annotations

from dataclasses import dataclass

from vmesh.services.common.runtime.peers import PeerSet


@dataclass
class Member:
    address: str
    retired: bool = False
    busy: int = 0
    stopped: bool = False
    retire_notices: int = 0


def peer_set() -> tuple[PeerSet[Member], list[str]]:
    started: list[str] = []

    def start(address: str) -> Member:
        started.append(address)
        return Member(address)

    def stop(member: Member) -> None:
        member.stopped = True

    def on_retire(member: Member) -> None:
        member.retire_notices += 1

    return PeerSet("test", start, is_idle=lambda m: m.busy == 0, stop=stop, on_retire=on_retire), started


def test_joining_starts_a_member_once():
    members, started = peer_set()
    a = members.add("a:1")
    assert members.add("a:1") is a
    members.update(["b:1", "a:1"], [])
    assert started == ["a:1", "b:1"]
    assert [m.address for m in members.active()] == ["a:1", "b:1"] and len(members) == 2


def test_a_busy_member_that_leaves_is_retired_until_its_work_ends():
    members, _ = peer_set()
    a, b = members.add("a:1"), members.add("b:1")
    a.busy = 1
    members.update([], ["a:1"])
    assert a.retired and a.retire_notices == 1 and not a.stopped
    assert "a:1" in members and members.is_retired("a:1") and members.active() == [b]
    assert not members.release_if_idle(a)  # still busy
    a.busy = 0
    assert members.release_if_idle(a)
    assert a.stopped and "a:1" not in members and not members.is_retired("a:1")


def test_an_idle_member_that_leaves_is_let_go_at_once():
    members, _ = peer_set()
    a = members.add("a:1")
    members.remove("a:1")
    assert a.stopped and "a:1" not in members
    members.remove("a:1")  # unknown now: nothing happens
    assert a.retire_notices == 1


def test_a_member_that_comes_back_before_it_is_idle_keeps_its_connection():
    members, started = peer_set()
    a = members.add("a:1")
    a.busy = 1
    members.remove("a:1")
    assert members.add("a:1") is a and not a.retired and started == ["a:1"]
    a.busy = 0
    assert not members.release_if_idle(a)  # listed again: it stays


def test_a_member_let_go_and_listed_again_is_a_new_member():
    members, started = peer_set()
    old = members.add("a:1")
    members.remove("a:1")
    new = members.add("a:1")
    assert new is not old and started == ["a:1", "a:1"]
    assert not members.release_if_idle(old)  # the old one's late release touches nothing
    assert members.get("a:1") is new and not new.stopped


def test_iterating_tolerates_members_leaving():
    members, _ = peer_set()
    for address in ("a:1", "b:1", "c:1"):
        members.add(address)
    for member in members:
        members.remove(member.address)
    assert len(members) == 0
