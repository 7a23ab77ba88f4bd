"""vLLM's `lora_requests_info` gauge, as `vmesh:lora_requests_info`: one series whose labels name
the adapters of the running and of the waiting requests (comma-separated) and the worker's
--max-loras, its value the time it was read (vLLM's convention for this info gauge)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vmesh.services.scheduler.scheduler import Scheduler


def adapters_in_use(scheduler: Scheduler) -> tuple[list[str], list[str]]:
    """(running requests' adapters, waiting requests' adapters), each sorted, without duplicates."""
    running = sorted({r.lora_name for r in scheduler.running if r.lora_name})
    waiting = sorted({r.lora_name for r in scheduler.waiting if r.lora_name})
    return running, waiting


class LoraRequestsInfo(Collector):
    """`model_name` labels the series too, as every vmesh series carries the model's name."""

    def __init__(self, scheduler: Callable[[], Scheduler | None], model_name: str):
        self.scheduler = scheduler
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        metric = GaugeMetricFamily("vmesh:lora_requests_info", "Running stats on LoRA requests.",
                                   labels=["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        scheduler = self.scheduler()
        if scheduler is not None:
            running, waiting = adapters_in_use(scheduler)
            metric.add_metric([self.model_name, str(scheduler.config.max_loras), ",".join(waiting), ",".join(running)],
                              time.time())
        yield metric
