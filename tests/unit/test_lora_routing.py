"""Routing LoRA requests (prefix_routing.order_by_cache over the groups' cache streams): to a group
where the adapter is active while it stays within the load bound, then to a new group with a slot
free for it, never to every group; and on a simulated mesh (real scheduler cores, two adapter
slots a group) against routing that ignores adapters."""

from __future__ import annotations

from dataclasses import dataclass

from tests.support.routing_simulation import serve_adapters
from vmesh.services.common.cache_events import CacheUpdate, CacheView, SchedulerLoad
from vmesh.services.common.wire.cache import cache_update_from_proto, cache_update_to_proto
from vmesh.services.frontend.prefix_routing import PromptRoute, order_by_cache

PROMPT = [7] * 40


@dataclass
class G:
    address: str
    cache: CacheView | None = None


def group(address: str, running: int, adapters: dict[str, int], max_loras: int = 2) -> G:
    load = SchedulerLoad(num_running=running, adapter_requests=tuple(sorted(adapters.items())), max_loras=max_loras)
    return G(address, CacheView(CacheUpdate(True, 16, 1, [], [], load)))


def test_an_adapter_goes_where_it_is_active_then_where_a_slot_is_free_never_everywhere():
    a, b, c = group("a", 2, {"sql": 2}), group("b", 1, {"poet": 1}, max_loras=1), group("c", 2, {"chef": 2})
    sql = PromptRoute(PROMPT, "sql")
    assert order_by_cache([a, b, c], sql)[0] is a  # active in a, within the bound ceil(1.25 * 6 / 3) = 3
    assert order_by_cache([a, b, c], PromptRoute(PROMPT))[0] is b  # the base model: least loaded
    a.cache.sent("sql")  # a at 3 passes the bound: sql moves on, to c's free slot (b's one is taken)
    assert order_by_cache([a, b, c], sql)[0] is c
    c.cache.sent("sql")
    for _ in range(7):
        a.cache.sent("sql")
    for _ in range(6):
        c.cache.sent("sql")
    # Both past the bound (9), but sql is active in all groups but one: no further, to the least loaded of its two.
    assert order_by_cache([a, b, c], sql)[0] is c
    assert order_by_cache([a, b, c], PromptRoute(PROMPT, "new"))[0] is b  # no free slot within the bound: least loaded


def test_the_stream_carries_each_adapters_requests_and_the_slot_count():
    load = SchedulerLoad(2, 1, 0.5, 10, (("poet", 1), ("sql", 2)), 4)
    update = CacheUpdate(True, 16, 1, [5], [], load, "x")
    assert cache_update_from_proto(cache_update_to_proto(update)) == update


def test_adapter_aware_routing_spreads_the_hot_adapter_over_some_groups_and_fills_fewer_slots():
    aware, blind = serve_adapters(aware=True), serve_adapters(aware=False)
    assert blind.most_hot_groups == 4  # load alone lets the hot adapter into every group
    assert 2 <= aware.most_hot_groups <= 3  # it spreads as its load grows, but never everywhere
    assert aware.cold_arrivals * 3 < blind.cold_arrivals * 2  # requests find their adapter in a slot
