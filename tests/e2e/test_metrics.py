"""Every service serves Prometheus metrics with vLLM's names under `vmesh:`, and a request
moves the key series."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.scrape import scrape, scrape_families
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient

VLLM_NAMES = Path(__file__).parent.parent / "fixtures/vllm_metric_names.txt"


def vllm_metric_names() -> list[str]:
    lines = (line.strip() for line in VLLM_NAMES.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_every_service_exports_metrics_that_move():
    mesh = start_mesh("--metrics", "--detokenizers", "2")
    try:
        assert set(mesh.metrics) == {"worker", "scheduler", "frontend", "detokenizer-0", "detokenizer-1"}
        for url in mesh.metrics.values():
            assert url.startswith("http://127.0.0.1:")

        async def main():
            async with VmeshClient(mesh.address) as client:
                return await asyncio.gather(*(
                    client.complete(chat=[{"role": "user", "content": f"Count to {i}"}], max_tokens=6,
                                    temperature=0, ignore_eos=True) for i in range(4)))

        asyncio.run(main())
        frontend = scrape(mesh.metrics["frontend"])
        assert frontend["vmesh:time_to_first_token_seconds_count"] == 4
        assert frontend["vmesh:e2e_request_latency_seconds_count"] == 4
        assert frontend["vmesh:inter_token_latency_seconds_count"] == 4 * 5
        assert frontend['vmesh:request_success_total{finished_reason="length"}'] == 4
        # A healthy mesh already has the failover series (at 0) that an alert would watch.
        for kind in ("scheduler", "detokenizer"):
            assert frontend[f'vmesh:request_failovers_total{{kind="{kind}"}}'] == 0
        # Token counts are the scheduler's alone: a sum across services counts each token once.
        assert "vmesh:generation_tokens_total" not in frontend and "vmesh:prompt_tokens_total" not in frontend
        scheduler = scrape(mesh.metrics["scheduler"])
        assert scheduler["vmesh:generation_tokens_total"] == 24
        assert scheduler["vmesh:request_queue_time_seconds_count"] == 4
        prompt_tokens = scheduler["vmesh:prompt_tokens_total"]
        assert scheduler["vmesh:request_prompt_tokens_sum"] == prompt_tokens > 0
        assert scheduler["vmesh:request_generation_tokens_count"] == 4
        assert scheduler["vmesh:request_generation_tokens_sum"] == 24
        for phase in ("prefill", "decode", "inference"):
            assert scheduler[f"vmesh:request_{phase}_time_seconds_count"] == 4
        assert scheduler["vmesh:request_inference_time_seconds_sum"] >= scheduler[
            "vmesh:request_decode_time_seconds_sum"]
        # Every step computes the 4 x 5 decode tokens past the first, plus what prefill did not find cached.
        assert scheduler["vmesh:iteration_tokens_total_count"] >= 6
        assert scheduler["vmesh:iteration_tokens_total_sum"] >= 4 * 5
        assert scheduler["vmesh:num_requests_running"] == 0 and scheduler["vmesh:num_requests_waiting"] == 0
        assert 0 <= scheduler["vmesh:kv_cache_usage_perc"] <= 1
        assert scheduler["vmesh:prefix_cache_queries_total"] > 0
        assert "vmesh:num_preemptions_total" in scheduler
        assert scheduler["vmesh:detokenizer_replicas_routable"] == 2
        worker = scrape(mesh.metrics["worker"])
        assert worker["vmesh:worker_steps_total"] >= 6
        assert 0 < worker["vmesh:worker_duty_cycle"] <= 1
        assert worker["vmesh:worker_step_seconds_count"] >= 6 and worker["vmesh:worker_batch_size_count"] >= 6
        # The step timeline: every step but the session's first follows another, and the scheduler
        # timed each step it sent and read back.
        steps = worker["vmesh:worker_steps_total"]
        assert worker["vmesh:worker_plan_wait_seconds_count"] == steps
        assert worker["vmesh:worker_plan_decode_seconds_count"] == steps
        assert worker["vmesh:worker_idle_gap_seconds_count"] == worker["vmesh:worker_waited_for_plan_seconds_count"]
        assert worker["vmesh:worker_idle_gap_seconds_count"] == steps - 1
        assert steps - 1 <= worker["vmesh:worker_result_encode_seconds_count"] <= steps
        for name in ("planning", "plan_encode", "step_round_trip", "step_outside_worker", "result_wait",
                     "result_handling"):
            assert 6 <= scheduler[f"vmesh:scheduler_{name}_seconds_count"] <= steps, name
        assert scheduler["vmesh:scheduler_step_round_trip_seconds_sum"] >= worker["vmesh:worker_step_seconds_sum"]
        detokenized = sum(scrape(mesh.metrics[f"detokenizer-{i}"])["vmesh:detokenizer_tokens_total"] for i in (0, 1))
        assert detokenized == 24

        # Every vLLM series vmesh claims, under the same name, from exactly one service.
        exported = {service: set(scrape_families(url)) for service, url in mesh.metrics.items()}
        for name in vllm_metric_names():
            ours = "vmesh:" + name.removeprefix("vllm:")
            owners = [service for service, names in exported.items() if ours in names]
            assert len(owners) == 1, (ours, owners)
    finally:
        mesh.stop()
