"""Replica discovery: specs re-resolved into joined and left addresses."""
from __future__ import annotations

import pytest

from vmesh.services.common.runtime.discovery import AddressBook, expand_addresses, resolve_spec


class FakeDns:
    def __init__(self, records: dict[str, list[str]]):
        self.records = records
        self.lookups = 0

    def __call__(self, spec: str) -> list[str]:
        self.lookups += 1
        if not spec.startswith("dns:///"):
            return [spec]
        if spec not in self.records:
            raise OSError(f"{spec}: name not known")
        return sorted(self.records[spec])


def test_static_specs_are_their_own_addresses():
    assert resolve_spec("127.0.0.1:5000") == ["127.0.0.1:5000"]
    assert expand_addresses(["127.0.0.1:1", "127.0.0.1:2"]) == ["127.0.0.1:1", "127.0.0.1:2"]
    assert not AddressBook(["127.0.0.1:1"]).dynamic


def test_refresh_reports_joined_and_left_replicas():
    dns = FakeDns({"dns:///detok:50054": ["10.0.0.1:50054", "10.0.0.2:50054"]})
    book = AddressBook(["dns:///detok:50054", "127.0.0.1:7"], resolve=dns)
    assert book.dynamic
    assert book.addresses == ["10.0.0.1:50054", "10.0.0.2:50054", "127.0.0.1:7"]
    assert book.refresh() == ([], [])
    dns.records["dns:///detok:50054"] = ["10.0.0.2:50054", "10.0.0.3:50054"]  # one scaled in, one out
    assert book.refresh() == (["10.0.0.3:50054"], ["10.0.0.1:50054"])
    assert book.addresses == ["10.0.0.2:50054", "10.0.0.3:50054", "127.0.0.1:7"]


def test_a_failed_re_resolution_keeps_the_known_replicas():
    dns = FakeDns({"dns:///detok:50054": ["10.0.0.1:50054"]})
    book = AddressBook(["dns:///detok:50054"], resolve=dns)
    del dns.records["dns:///detok:50054"]
    assert book.refresh() == ([], [])
    assert book.addresses == ["10.0.0.1:50054"]


def test_the_first_resolution_must_succeed():
    with pytest.raises(OSError, match="name not known"):
        AddressBook(["dns:///nowhere:1"], resolve=FakeDns({}))
    with pytest.raises(ValueError):
        AddressBook([])


def test_watch_reports_changes_and_returns_for_a_fixed_list():
    import asyncio

    from vmesh.services.common.runtime.discovery import watch

    async def main() -> list:
        dns = FakeDns({"dns:///detok:1": ["10.0.0.1:1"]})
        book = AddressBook(["dns:///detok:1"], resolve=dns)
        changes: list = []
        task = asyncio.create_task(watch(book, 0.0, lambda joined, left: changes.append((joined, left))))
        dns.records["dns:///detok:1"] = ["10.0.0.2:1"]
        while not changes:
            await asyncio.sleep(0.01)
        task.cancel()
        await watch(AddressBook(["127.0.0.1:1"]), 0.0, changes.append)  # static: nothing to watch
        return changes

    assert asyncio.run(asyncio.wait_for(main(), 10)) == [(["10.0.0.2:1"], ["10.0.0.1:1"])]
