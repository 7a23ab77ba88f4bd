"""Decode first, on the real scheduler and a cost model: what max_prefill_tokens_with_decodes does
to a burst's latencies, free of this machine's load. vLLM's client's burst (N prompts of 256
tokens, 128 out, EOS ignored, 32 in flight: a finished request's slot takes the next prompt at
once) is scheduled step by step by the real Scheduler against a stub worker; each step's time is
the cost model's: a decode step of R rows costs BASE + ROW * R ms (the runner's recorded decode
steps, benchmarks/README.md "Model runner decode against transformers": 27 ms at 1 row, 86 ms at
32) and each prefill token PREFILL ms (float32's linears at ~190 GFLOP/s, "Where the time goes":
~1.1 ms a token). The figures are what the schedule alone implies, at pipeline depth 1.

    .venv/bin/python -m benchmarks.decode_first [--prompts 64] [--caps 0,64,128,256,512] [--prefill-ms 1.1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import deque

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.request import Request

BASE_MS, ROW_MS, PREFILL_MS = 25.1, 1.9, 1.1
INPUT_LEN, OUTPUT_LEN, CONCURRENCY, BUDGET, BLOCK = 256, 128, 32, 2048, 16


def burst(cap: int, prompts: int, prefill_ms: float = PREFILL_MS) -> dict[str, float]:
    scheduler = make_scheduler(num_blocks=4096, block_size=BLOCK, max_model_len=1024, max_num_seqs=256,
                               max_num_batched_tokens=BUDGET, hash_seed=0, max_prefill_tokens_with_decodes=cap)
    worker = StubWorker(4096, BLOCK)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    queue = deque(Request(f"r{i}", [(7 * i + 3 * j) % 5000 + 1 for j in range(INPUT_LEN)], params)
                  for i in range(prompts))
    arrived: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    now, in_flight, worst_prefill_beside_decodes = 0.0, 0, 0
    while queue or scheduler.has_unfinished():
        while queue and in_flight < CONCURRENCY:
            request = queue.popleft()
            scheduler.add_request(request)
            arrived[request.request_id], in_flight = now, in_flight + 1
        plan = scheduler.schedule()
        assert plan is not None
        decodes = sum(1 for n in plan.num_scheduled_tokens if n == 1)
        prefill = plan.total_scheduled_tokens - decodes
        if decodes:
            worst_prefill_beside_decodes = max(worst_prefill_beside_decodes, prefill)
        now += BASE_MS + ROW_MS * len(plan.scheduled_handles) + prefill_ms * prefill
        for update in scheduler.update(worker.execute(plan)):
            token_times.setdefault(update.request_id, []).extend([now] * len(update.new_token_ids))
            in_flight -= update.finish_reason is not None
    ttft = [times[0] - arrived[r] for r, times in token_times.items()]
    itl = [b - a for times in token_times.values() for a, b in itertools.pairwise(times)]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times.values()]
    return {"cap": cap, "output_tok_s": prompts * OUTPUT_LEN / now * 1e3, "ttft_p50_ms": statistics.median(ttft),
            "tpot_mean_ms": statistics.fmean(tpot), "itl_p99_ms": statistics.quantiles(itl, n=100)[98],
            "itl_max_ms": max(itl), "max_prefill_tokens_beside_decodes": worst_prefill_beside_decodes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--caps", default="0,64,128,256,512")
    parser.add_argument("--prefill-ms", type=float, default=PREFILL_MS, help="cost model: ms per prefill token")
    args = parser.parse_args()
    rows = [burst(int(cap), args.prompts, args.prefill_ms) for cap in args.caps.split(",")]
    print("| cap | output tok/s | TTFT p50 ms | TPOT mean ms | ITL p99 ms | ITL max ms | prefill beside decodes |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cap']} | {r['output_tok_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['tpot_mean_ms']:.1f} | "
              f"{r['itl_p99_ms']:.0f} | {r['itl_max_ms']:.0f} | {r['max_prefill_tokens_beside_decodes']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
