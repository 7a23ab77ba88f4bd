"""LoRA's pieces without a model: the per-adapter prefix-cache root, the scheduler's adapter limit
and gauge, the grouping of a step's tokens, --lora-modules, and the all-or-none rollout."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from tests.support.factories import make_scheduler
from vmesh.services.common.lora_rollout import RolloutFailed, load_everywhere, unload_everywhere
from vmesh.services.common.types import SamplingParams
from vmesh.services.frontend.prefix_routing import prefix_hashes
from vmesh.services.scheduler.lora_metrics import LoraRequestsInfo
from vmesh.services.scheduler.request import Request
from vmesh.services.worker.config import parse_lora_modules
from vmesh.services.worker.lora import LoraBatch, LoraLinear, StepAdapters
from vmesh.v1 import common_pb2

PROMPT = list(range(1, 18))  # four full blocks of 4, and one token more


def _request(key: str, lora_name: str = "", prompt: list[int] = PROMPT) -> Request:
    return Request(key, list(prompt), SamplingParams(temperature=0.0, max_tokens=4), lora_name=lora_name)


def test_prefix_hashes_differ_by_adapter_and_the_cache_keeps_adapters_apart():
    scheduler = make_scheduler(num_blocks=32, hash_seed=0, max_loras=2)
    pool = scheduler.pool
    base, sql, poet = (pool.hash_blocks(PROMPT, lora_name=name) for name in ("", "sql", "poet"))
    assert len({*base, *sql, *poet}) == 3 * len(base)  # no block hash shared between any two
    assert pool.hash_blocks(PROMPT, lora_name="sql") == sql  # and each is stable
    # The frontend's routing hashes too.
    assert len({*prefix_hashes(PROMPT * 4), *prefix_hashes(PROMPT * 4, "sql")}) == 2 * len(prefix_hashes(PROMPT * 4))

    first = _request("a", "sql")
    scheduler.add_request(first)
    plan = scheduler.schedule()
    assert plan is not None and plan.new_requests[0].lora_name == "sql"
    scheduler._register_full_blocks(first)  # its prompt's blocks are in the cache now
    for key, name, cached in (("b", "", 0), ("c", "poet", 0), ("d", "sql", 16)):
        request = _request(key, name)
        scheduler.add_request(request)
        scheduler.schedule()
        assert request.num_cached_prompt_tokens == cached, name


def test_a_new_adapter_waits_while_max_loras_others_run():
    scheduler = make_scheduler(num_blocks=64, max_loras=2, max_num_batched_tokens=256)
    requests = [_request("a", "sql"), _request("b", "poet"), _request("c", "chef"), _request("d", "sql"),
                _request("e")]
    for request in requests:
        scheduler.add_request(request)
    plan = scheduler.schedule()
    assert plan is not None
    # FCFS stops at the third adapter: two slots hold sql and poet.
    assert [r.lora_name for r in plan.new_requests] == ["sql", "poet"]
    labels = _gauge_labels(scheduler)
    assert labels == {"model_name": "m", "max_lora": "2", "running_lora_adapters": "poet,sql",
                      "waiting_lora_adapters": "chef,sql"}


def _gauge_labels(scheduler) -> dict[str, str]:
    (family,) = LoraRequestsInfo(lambda: scheduler, "m").collect()
    (sample,) = family.samples
    assert family.name == "vmesh:lora_requests_info" and sample.value > 0
    return sample.labels


def test_tokens_grouped_by_slot_with_padding_marked():
    batch = LoraBatch.from_token_slots(torch.tensor([-1, 2, 0, 2, -1, 0, 2]))
    assert batch is not None
    assert batch.slots.tolist() == [0, 2]
    assert batch.token_index.tolist() == [[2, 5, 0], [1, 3, 6]]
    assert batch.valid.tolist() == [[True, True, False], [True, True, True]]
    assert batch.flat_index.tolist() == [2, 5, 1, 3, 6]
    assert batch.slot_range is None and batch.whole_step_slot is None  # slots 0 and 2: gathered
    assert batch.padded_index.tolist() == [2, 5, 0, 1, 3, 6]  # padding names token 0
    stack = torch.arange(4.0)
    assert batch.stacked(stack).tolist() == [0.0, 2.0]
    consecutive = LoraBatch.from_token_slots(torch.tensor([3, 2, 2]))
    assert consecutive is not None and consecutive.slot_range == slice(2, 4)
    assert consecutive.stacked(stack).tolist() == [2.0, 3.0] and consecutive.stacked(stack)._base is stack
    whole = LoraBatch.from_token_slots(torch.tensor([1, 1, 1]))
    assert whole is not None and whole.whole_step_slot == 1 and consecutive.whole_step_slot is None
    assert LoraBatch.from_token_slots(torch.tensor([1, -1])).whole_step_slot is None  # a base token too
    assert LoraBatch.from_token_slots(torch.tensor([-1, -1])) is None


class _Dense:
    def __init__(self, weight: torch.Tensor):
        self.weight, self.out_features, self.in_features = weight, *weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


@pytest.mark.parametrize("token_slots", [[2, -1, 0, 2, 1, -1, 0, 2], [1, 1, 1, 1], [3, -1, 3], [-1, -1]])
def test_an_adapted_linear_adds_each_tokens_own_slots_product(token_slots):
    """Mixed steps (padding, base tokens), one adapter on every token (the dense path), and none."""
    generator = torch.Generator().manual_seed(0)
    base = _Dense(torch.randn(12, 8, generator=generator, dtype=torch.float64))
    step = StepAdapters()
    linear = LoraLinear(base, max_loras=4, band_width=3, step=step, dtype=torch.float64, device=torch.device("cpu"))
    for slot in range(4):
        linear.write_slot(slot, (torch.randn(8, 3, generator=generator, dtype=torch.float64),
                                 torch.randn(3, 12, generator=generator, dtype=torch.float64)))
    x = torch.randn(len(token_slots), 8, generator=generator, dtype=torch.float64)
    step.set(LoraBatch.from_token_slots(torch.tensor(token_slots)))
    expected = torch.stack([base(row) + (row @ linear.lora_a[s] @ linear.lora_b[s] if s >= 0 else 0)
                            for row, s in zip(x, token_slots)])
    torch.testing.assert_close(linear(x), expected, rtol=1e-12, atol=1e-12)


def test_lora_modules_parse_as_vllm_writes_them():
    assert parse_lora_modules(["sql=/a/b", " poet = /c "]) == {"sql": "/a/b", "poet": "/c"}
    with pytest.raises(ValueError, match="expected name=path"):
        parse_lora_modules(["sql"])
    with pytest.raises(ValueError, match="names 'sql' twice"):
        parse_lora_modules(["sql=/a", "sql=/b"])


class _Refused(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), detail)


class _Peer:
    def __init__(self, fail_load: str = "", fail_unload: str = ""):
        self.held: set[str] = set()
        self.fail_load, self.fail_unload = fail_load, fail_unload

    async def LoadLoraAdapter(self, request, timeout):
        if self.fail_load:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, self.fail_load)
        self.held.add(request.lora_name)
        return common_pb2.LoraAdapterResponse(lora_adapters=sorted(self.held))

    async def UnloadLoraAdapter(self, request, timeout):
        if self.fail_unload:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, self.fail_unload)
        self.held.discard(request.lora_name)
        return common_pb2.LoraAdapterResponse(lora_adapters=sorted(self.held))


def test_a_failed_load_is_undone_where_it_succeeded_and_names_the_peer():
    peers = [_Peer(), _Peer(), _Peer(fail_load="no adapter_config.json in /x"), _Peer()]
    named = [(f"rank {i}", peer) for i, peer in enumerate(peers)]
    with pytest.raises(RolloutFailed) as failed:
        asyncio.run(load_everywhere(named, "sql", "/x"))
    assert failed.value.where == "rank 2" and failed.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(failed.value) == "rank 2: no adapter_config.json in /x"
    assert all(not peer.held for peer in peers)  # the two that loaded it unloaded it; the last was never asked
    assert asyncio.run(load_everywhere(named[:2], "sql", "/x")) == ["sql"]


def test_an_unload_reaches_every_peer_and_reports_the_first_failure():
    peers = [_Peer(fail_unload="gone"), _Peer()]
    for peer in peers:
        peer.held.add("sql")
    with pytest.raises(RolloutFailed, match="rank 0: gone"):
        asyncio.run(unload_everywhere([(f"rank {i}", p) for i, p in enumerate(peers)], "sql"))
    assert peers[1].held == set()
