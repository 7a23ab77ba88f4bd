"""The scheduler -> frontend cache stream (WatchCache): CacheUpdate <-> scheduler_pb2.CacheUpdate."""

from __future__ import annotations

from vmesh.services.common.cache_events import CacheUpdate, SchedulerLoad
from vmesh.v1 import scheduler_pb2


def cache_update_to_proto(u: CacheUpdate) -> scheduler_pb2.CacheUpdate:
    load = u.load
    return scheduler_pb2.CacheUpdate(
        snapshot=u.snapshot, block_size=u.block_size, hash_seed=u.hash_seed, stored=u.stored, removed=u.removed,
        load=scheduler_pb2.SchedulerLoad(num_running=load.num_running, num_waiting=load.num_waiting,
                                         kv_cache_usage=load.kv_cache_usage,
                                         num_waiting_prompt_tokens=load.num_waiting_prompt_tokens,
                                         adapter_requests=dict(load.adapter_requests), max_loras=load.max_loras),
        incarnation=u.incarnation)


def cache_update_from_proto(m: scheduler_pb2.CacheUpdate) -> CacheUpdate:
    load = m.load
    return CacheUpdate(m.snapshot, m.block_size, m.hash_seed, list(m.stored), list(m.removed),
                       SchedulerLoad(load.num_running, load.num_waiting, load.kv_cache_usage,
                                     load.num_waiting_prompt_tokens, tuple(sorted(load.adapter_requests.items())),
                                     load.max_loras), m.incarnation)
