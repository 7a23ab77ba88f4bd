"""Routing by the schedulers' cache streams against each frontend's own table and an oracle,
on a simulated mesh (real scheduler cores and block pools over stub workers; no model).

    python -m benchmarks.cache_routing [--requests 720] [--out benchmarks/results/cache_routing.json]

Two frontends take a hot-prefix workload (16 shared 160-token prefixes, one of them ~40 % of
the requests, 12-token questions) in turns, three requests per scheduler step, over 1, 2 and 3
groups whose KV pools hold only a part of the prefixes. Per routing and group count: the
prefix-cache hit rate (blocks found over blocks looked up, all groups) and the busiest group's
share of the requests over the idlest's. What the simulation cannot give is time: the real
mesh's throughput and TTFT under this routing are measured by benchmarks/prefix_routing.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.support.routing_simulation import serve

ROUTINGS = ("oracle", "exact", "table")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=720)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for groups in (1, 2, 3):
        for routing in ROUTINGS:
            hit_rate, taken = serve(routing, groups=groups, requests=args.requests)
            rows.append({"groups": groups, "routing": routing, "hit_rate": round(hit_rate, 4), "taken": taken,
                         "busiest_over_idlest": round(max(taken) / min(taken), 3)})
            print(f"{groups} group(s) {routing:>6}: hit rate {hit_rate:.3f}, requests per group {taken}")
    if args.out is not None:
        args.out.write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
