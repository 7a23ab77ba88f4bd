"""Every service serves Prometheus metrics with vLLM's names under `vmesh:`, and a request
moves the key series."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from services.client import VmeshClient
from services.mesh_process import start_mesh


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


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
        assert frontend["vmesh:generation_tokens_total"] == 24
        scheduler = scrape(mesh.metrics["scheduler"])
        assert scheduler["vmesh:generation_tokens_total"] == 24
        assert scheduler["vmesh:request_queue_time_seconds_count"] == 4
        assert scheduler["vmesh:num_requests_running"] == 0 and scheduler["vmesh:num_requests_waiting"] == 0
        assert 0 <= scheduler["vmesh:kv_cache_usage_perc"] <= 1
        assert scheduler["vmesh:prefix_cache_queries_total"] > 0
        assert "vmesh:num_preemptions_total" in scheduler
        assert scheduler["vmesh:detokenizer_replicas_routable"] == 2
        worker = scrape(mesh.metrics["worker"])
        assert worker["vmesh:worker_steps_total"] >= 6
        assert 0 < worker["vmesh:worker_duty_cycle"] <= 1
        assert worker["vmesh:worker_step_seconds_count"] >= 6 and worker["vmesh:worker_batch_size_count"] >= 6
        detokenized = sum(scrape(mesh.metrics[f"detokenizer-{i}"])["vmesh:detokenizer_tokens_total"] for i in (0, 1))
        assert detokenized == 24
    finally:
        mesh.stop()
