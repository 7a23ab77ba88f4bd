"""The scheduler's side of speculation: draft slots reserved within max_tokens and the context,
placeholders at their upper bound until the result settles them, blocks never leaked, the
batch-size policy, and the counters exported under vLLM's spec_decode names."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from tests.support.factories import make_scheduler
from vmesh.services.common.step_types import StepResult
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.server import AcceptedPerPosition, SchedulerServicer


def _result(plan, kept: dict[int, list[int]], drafted: dict[int, int]) -> StepResult:
    handles = [h for h in plan.scheduled_handles if h in kept]
    return StepResult(step=plan.step, handles=handles, sampled_token_ids=[t for h in handles for t in kept[h]],
                      num_sampled_tokens=[len(kept[h]) for h in handles],
                      num_draft_tokens=[drafted.get(h, 0) for h in handles])


def test_depth_two_plans_stay_within_the_bound_and_settle_to_the_truth():
    scheduler = make_scheduler(num_blocks=32, block_size=4, num_speculative_tokens=3)
    request = Request("r", list(range(10)), SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    scheduler.add_request(request)
    prefill = scheduler.schedule()
    assert prefill.num_draft_slots == [0]  # a prefill does not speculate
    first = scheduler.schedule()  # planned before the prefill's token is known
    assert first.num_scheduled_tokens == [1] and first.num_draft_slots == [3]
    assert request.num_placeholders == 1 + 4 and request.num_computed_tokens == 10 + 1 + 3
    assert len(request.block_ids) == 4  # room for the 14 tokens the worker may compute
    scheduler.update(_result(prefill, {0: [50]}, {}))
    second = scheduler.schedule()  # before the first decode's acceptance is known
    # 1 output known + at most 4 in flight: this step may keep 1 + 3 more and still end at max_tokens 9.
    assert second.num_draft_slots == [3]
    scheduler.update(_result(first, {0: [51, 52]}, {0: 3}))  # one of three drafts kept
    assert request.output_token_ids == [50, 51, 52]
    # The second decode (1 + 3 slots) is still in flight; the rejected slots were given back.
    assert request.num_placeholders == 4 and request.num_computed_tokens == 12 + 1 + 3
    updates = scheduler.update(_result(second, {0: [53, 54, 55]}, {0: 3}))
    assert updates[0].new_token_ids == [53, 54, 55] and request.num_placeholders == 0
    assert request.num_computed_tokens == request.num_tokens - 1  # the last token's KV is next step's
    third = scheduler.schedule()
    assert third.num_draft_slots == [2] and sum(scheduler.spec_stats.accepted_per_position) == 3
    scheduler.update(_result(third, {0: [56, 57, 58]}, {0: 2}))
    assert len(request.output_token_ids) == 9 and request.is_finished  # max_tokens, never past it
    assert scheduler.pool.num_free == scheduler.pool.num_blocks
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 5)
    assert stats.accepted_per_position == [3, 2, 0]


def test_a_stop_token_inside_the_kept_tokens_drops_the_rest():
    scheduler = make_scheduler(num_blocks=32, num_speculative_tokens=4)
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[9]))
    scheduler.add_request(request)
    scheduler.update(_result(scheduler.schedule(), {0: [4]}, {}))
    plan = scheduler.schedule()
    updates = scheduler.update(_result(plan, {0: [5, 9, 6, 7]}, {0: 4}))
    assert updates[0].new_token_ids == [5, 9] and request.is_finished
    assert scheduler.pool.num_free == scheduler.pool.num_blocks


def test_large_batches_do_not_speculate():
    scheduler = make_scheduler(num_blocks=64, num_speculative_tokens=2, speculative_disable_by_batch_size=3)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20)))
    plan = scheduler.schedule()
    scheduler.update(_result(plan, {h: [4] for h in plan.scheduled_handles}, {}))
    assert scheduler.schedule().num_draft_slots == [0, 0, 0]  # three running: off


def test_counters_carry_vllm_names():
    scheduler = make_scheduler(num_blocks=8, num_speculative_tokens=2)
    scheduler.spec_stats.record(2, 1)
    scheduler.spec_stats.record(2, 2)
    session = SimpleNamespace(scheduler=scheduler, workers=SimpleNamespace(traffic=SimpleNamespace(steps=0,
                              plan_bytes=0)), worker_failovers=0, router=SimpleNamespace(routable=lambda: []))
    servicer = SchedulerServicer(session)  # type: ignore[arg-type]
    scraped = servicer.scraped_metrics()
    assert scraped["vmesh:spec_decode_num_drafts"][2] == 2
    assert scraped["vmesh:spec_decode_num_draft_tokens"][2] == 4
    assert scraped["vmesh:spec_decode_num_accepted_tokens"][2] == 3
    registry = CollectorRegistry()
    registry.register(AcceptedPerPosition(servicer.spec_stats, "m"))
    text = generate_latest(registry).decode()
    assert 'vmesh:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0' in text
    assert 'vmesh:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text


def test_draft_columns_cross_the_wire():
    from vmesh.services.common.step_types import StepPlan
    from vmesh.services.common.wire.step import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto

    plan = StepPlan(step=3, scheduled_handles=[4, 9], num_scheduled_tokens=[1, 1], num_draft_slots=[4, 0])
    assert plan_from_proto(plan_to_proto(plan)).num_draft_slots == [4, 0]
    result = StepResult(step=3, handles=[4, 9], sampled_token_ids=[1, 2, 3, 8], num_sampled_tokens=[3, 1],
                        num_draft_tokens=[4, 0])
    back = result_from_proto(result_to_proto(result))
    assert (back.sampled_token_ids, back.num_sampled_tokens, back.num_draft_tokens) == ([1, 2, 3, 8], [3, 1], [4, 0])


def test_a_request_whose_drafts_keep_failing_stops_speculating_but_probes():
    scheduler = make_scheduler(num_blocks=64, num_speculative_tokens=2)
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    scheduler.add_request(request)
    scheduler.update(_result(scheduler.schedule(), {0: [4]}, {}))
    slots = []
    for token in range(5, 30):
        plan = scheduler.schedule()
        slots.append(plan.num_draft_slots[0])
        scheduler.update(_result(plan, {0: [token]}, {0: plan.num_draft_slots[0]}))  # every draft rejected
    assert slots[:5] == [2] * 5  # the rate falls from 1 by 0.7 a step: 0.17 after five
    assert 0 in slots and slots[5:].count(2) == len(slots[5:]) // 8, slots


def test_a_request_span_carries_its_acceptance():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vmesh.services.common.types import FinishReason
    from vmesh.services.scheduler.lifetimes import Lifetimes
    from vmesh.services.scheduler.scheduler import RequestUpdate

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    lifetimes = Lifetimes()
    life = lifetimes.begin("a/1", 5, None, {})
    life.span = provider.get_tracer("test").start_span("scheduler.request")
    lifetimes.stepped([RequestUpdate("a/1", [1, 2, 3], num_draft_tokens=4, num_accepted_tokens=2)], 1.0)
    lifetimes.stepped([RequestUpdate("a/1", [4], FinishReason.LENGTH, num_draft_tokens=3)], 2.0)
    (span,) = exporter.get_finished_spans()
    assert span.attributes["vmesh.spec_decode.num_draft_tokens"] == 7
    assert span.attributes["vmesh.spec_decode.num_accepted_tokens"] == 2
