"""Exact routing (prefix_routing.order_by_cache) over the views every scheduler's cache stream
gives every frontend: the rule itself, then three groups (real scheduler cores, stub workers,
small KV pools) and two frontends on a hot-prefix workload, against an oracle that reads every
pool directly and against the per-frontend tables used when the streams are down."""
from __future__ import annotations

from dataclasses import dataclass

from tests.support.routing_simulation import serve
from vmesh.services.common.cache_events import CacheUpdate, CacheView, SchedulerLoad
from vmesh.services.common.prefix_hash import chained_block_hashes
from vmesh.services.frontend.prefix_routing import PromptRoute, order_by_cache

BLOCK = 16
SEED = 12345


@dataclass
class G:
    address: str
    cache: CacheView | None = None
    in_flight: int = 0


def view(prompts: list[list[int]], running: int) -> CacheView:
    blocks = [h for p in prompts for h in chained_block_hashes(p, BLOCK, SEED)]
    return CacheView(CacheUpdate(True, BLOCK, SEED, blocks, [], SchedulerLoad(num_running=running)))


def test_the_longest_cached_prefix_within_the_load_bound_goes_first():
    shared = list(range(64))
    a = G("a", view([shared[:32]], running=2))
    b = G("b", view([shared], running=2))
    c = G("c", view([], running=1))
    assert order_by_cache([a, b, c], PromptRoute([*shared, 1])) == [b, c, a]  # b holds 4 blocks; then by load
    b.cache = view([shared], running=5)  # the bound: ceil(1.25 * (2 + 5 + 1 + 1) / 3) = 4 requests
    assert order_by_cache([a, b, c], PromptRoute([*shared, 1])) == [a, c, b]  # b passes it: a holds the most else
    assert order_by_cache([a, b, c], PromptRoute([999] * 40)) == [c, a, b]  # nothing cached anywhere: least loaded
    a.cache.sent_since_update = 3  # this frontend's own sends since a's report count as load
    assert order_by_cache([a, b, c], PromptRoute([*shared, 1]))[0] is c  # bound 5: only c stays within it


def test_exact_views_route_as_well_as_an_oracle_and_keep_the_groups_balanced():
    oracle_hits, _ = serve("oracle", groups=3)
    exact_hits, taken = serve("exact", groups=3)
    table_hits, _ = serve("table", groups=3)
    assert exact_hits >= 0.9 * oracle_hits, (exact_hits, oracle_hits)
    assert max(taken) <= 1.5 * min(taken), taken
    # Two frontends' own tables each see half the traffic: the shared exact view does better.
    print(f"hit rate: oracle {oracle_hits:.3f}, exact {exact_hits:.3f}, tables {table_hits:.3f}; taken {taken}")
    assert exact_hits > table_hits, (exact_hits, table_hits)
