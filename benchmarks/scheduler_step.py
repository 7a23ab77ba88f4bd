"""Scheduler cost per step: 256 running requests decoding, a stub worker, microseconds per
schedule() + update() round.

    .venv/bin/python -m benchmarks.scheduler_step [--requests 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import time

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.request import Request


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    num_blocks, block = 40_000, 16
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=block, max_model_len=4096, max_num_seqs=args.requests,
                               max_num_batched_tokens=args.requests * 64)
    worker = StubWorker(num_blocks, block)
    for i in range(args.requests):
        scheduler.add_request(Request(f"r{i}", [(i + j) % 90 + 1 for j in range(40)],
                                      SamplingParams(temperature=0, max_tokens=args.steps + 10, ignore_eos=True)))
    scheduler.update(worker.execute(scheduler.schedule()))  # every prefill in one step
    schedule_s = update_s = 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        result = worker.execute(plan)
        t2 = time.perf_counter()
        scheduler.update(result)
        t3 = time.perf_counter()
        schedule_s += t1 - t0
        update_s += t3 - t2
    n = args.steps
    print(f"{args.requests} running requests: schedule {schedule_s / n * 1e6:.0f} us/step, "
          f"update {update_s / n * 1e6:.0f} us/step, total {(schedule_s + update_s) / n * 1e6:.0f} us/step")


if __name__ == "__main__":
    main()
