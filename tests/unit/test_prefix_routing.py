"""Prefix-aware routing across scheduler groups: the group that saw the longest run of a
prompt's leading chunks goes first; load breaks ties; an overloaded group is passed over; a
group whose cache is gone is forgotten."""
from __future__ import annotations

from dataclasses import dataclass

from vmesh.services.frontend.prefix_routing import CHUNK_TOKENS, MAX_CHUNKS, PrefixRouter, PromptRoute, prefix_hashes


@dataclass
class G:
    address: str
    in_flight: int = 0


def prompt(prefix: int, length: int, suffix: int = 0) -> list[int]:
    """`length` tokens of shared prefix number `prefix`, then 5 tokens of suffix `suffix`."""
    return [prefix * 1000 + i for i in range(length)] + [suffix * 7 + j for j in range(5)]


def test_hashes_chain_over_full_leading_chunks():
    a, b = prompt(1, 3 * CHUNK_TOKENS, 1), prompt(1, 3 * CHUNK_TOKENS, 2)
    assert len(prefix_hashes(a)) == 3 and prefix_hashes(a) == prefix_hashes(b)  # suffixes in no full chunk
    c = prompt(1, 2 * CHUNK_TOKENS) + prompt(2, CHUNK_TOKENS)
    assert prefix_hashes(c)[:2] == prefix_hashes(a)[:2] and prefix_hashes(c)[2] != prefix_hashes(a)[2]
    assert prefix_hashes(list(range(CHUNK_TOKENS - 1))) == []
    assert len(prefix_hashes(list(range(10 * MAX_CHUNKS * CHUNK_TOKENS)))) == MAX_CHUNKS


def test_the_group_that_saw_the_prefix_goes_first_unless_overloaded():
    router = PrefixRouter()
    a, b = G("a", in_flight=3), G("b", in_flight=1)
    shared = prefix_hashes(prompt(1, 4 * CHUNK_TOKENS))
    assert router.order([b, a], shared) == [b, a]  # nothing seen: least busy first
    router.routed("a", shared)
    assert router.order([b, a], shared) == [a, b]  # a holds the prefix; 3 in flight is not overload
    assert router.order([b, a], prefix_hashes(prompt(2, 4 * CHUNK_TOKENS))) == [b, a]  # another prefix
    a.in_flight = 2 * b.in_flight + 5
    assert router.order([b, a], shared) == [b, a]  # overloaded: passed over


def test_the_longest_match_wins_and_load_breaks_ties():
    router = PrefixRouter()
    a, b, c = G("a", 2), G("b", 1), G("c", 0)
    long_prompt = prefix_hashes(prompt(1, 6 * CHUNK_TOKENS))
    router.routed("a", long_prompt[:2])
    router.routed("b", long_prompt[:5])
    assert router.order([c, b, a], long_prompt)[0] is b
    router.routed("c", long_prompt[:5])
    assert router.order([c, b, a], long_prompt)[0] is c  # as long a match, fewer in flight


def test_tables_are_bounded_and_forgotten():
    router = PrefixRouter(table_entries=4)
    first, second = prefix_hashes(prompt(1, 3 * CHUNK_TOKENS)), prefix_hashes(prompt(2, 3 * CHUNK_TOKENS))
    router.routed("a", first)
    router.routed("a", second)
    assert len(router.tables["a"]) == 4
    assert router.matched("a", second) == 3 and router.matched("a", first) == 0  # its head went first
    router.forget("a")
    assert router.matched("a", second) == 0


def test_the_scheduler_pool_orders_candidates_by_prefix():
    import asyncio

    from tests.support.fake_scheduler import FakeScheduler
    from tests.support.grpc_fakes import FakeChannel, healthy_forever
    from vmesh.services.frontend.schedulers import SchedulerPool

    async def main():
        orders = {}
        for routing in ("prefix", "prefix-table", "least-busy"):
            pool = SchedulerPool(lambda address: (FakeScheduler(), FakeChannel()), health_stream=healthy_forever,
                                 routing=routing)
            a, b = pool.add("a:1"), pool.add("b:1")
            await asyncio.gather(a.joined.wait(), b.joined.wait())
            route = PromptRoute(prompt(1, 2 * CHUNK_TOKENS))
            pool.acquire(b)
            pool.routed(b, route)
            orders[routing] = [g.address for g in pool.candidates(route)]
            await pool.close()
        return orders

    assert asyncio.run(main()) == {"prefix": ["b:1", "a:1"], "prefix-table": ["b:1", "a:1"],
                                   "least-busy": ["a:1", "b:1"]}
