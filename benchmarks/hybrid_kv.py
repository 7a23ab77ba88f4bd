"""KV blocks held by one long Gemma 3 270M request: the hybrid layout (KV cache groups, the
local layers' groups keeping only their 512-token window) against all-global (every layer
holding the whole context), on the real scheduler and a stub worker (which checks that every
position each step reads holds the request's own token).

Gemma 3 270M: 18 layers, five local (window 512) to one global, 1 KV head of 256, KV cache in
float32, blocks of 16 tokens. Its layout: one global group of 3 layers and five local groups of
3, a block holding 3 layers; all-global, a request needs, per 16 tokens, 6 such blocks (18
layers). A request of --contexts tokens in all: its prompt (all but the last --decode) is
prefilled in chunks of --budget tokens, then --decode tokens are generated; counted at its last step.

    .venv/bin/python -m benchmarks.hybrid_kv [--contexts 1024,4096,8192,32768] [--budget 2048] [--decode 64]
"""

from __future__ import annotations

import argparse
import json

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker
from vmesh.services.common.kv_cache_groups import kv_cache_layout
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.request import Request

LAYERS, WINDOW, KV_HEADS, HEAD_DIM, FLOAT32, BLOCK, MAX_MODEL_LEN = 18, 512, 1, 256, 4, 16, 32768
GEMMA3_WINDOWS = [None if (i + 1) % 6 == 0 else WINDOW for i in range(LAYERS)]
MIB = 1 << 20


def held_by_one_request(context: int, budget: int, decode: int) -> dict[str, float]:
    layout = kv_cache_layout(GEMMA3_WINDOWS, MAX_MODEL_LEN)
    block_bytes = 2 * layout.slots_per_block * BLOCK * KV_HEADS * HEAD_DIM * FLOAT32
    num_blocks = len(layout.groups) * (-(-context // BLOCK))  # all-global fits: nothing is preempted
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                               max_num_batched_tokens=budget, hash_seed=0, kv_cache_windows=layout.windows)
    worker = StubWorker(num_blocks, BLOCK, windows=layout.windows)
    prompt = [(7 * j) % 5000 + 1 for j in range(context - decode)]
    scheduler.add_request(Request("long", prompt, SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)))
    request = scheduler.requests["long"]
    peak_prefill = held_after_prefill = held_at_end = entries_at_end = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert plan is not None
        if "long" in scheduler.requests:
            held = len(request.block_ids)
            if request.num_computed_tokens <= len(prompt):
                peak_prefill = max(peak_prefill, held)
            elif not held_after_prefill:
                held_after_prefill = held
            held_at_end, entries_at_end = held, len(request.tables)
        scheduler.update(worker.execute(plan))
    all_global = len(layout.groups) * entries_at_end
    return {"context": context, "prompt": len(prompt), "decoded": decode, "blocks_all_global": all_global,
            "blocks_hybrid": held_at_end,
            "blocks_hybrid_peak_in_prefill": peak_prefill, "blocks_hybrid_first_decode": held_after_prefill,
            "mib_all_global": round(all_global * block_bytes / MIB, 1),
            "mib_hybrid": round(held_at_end * block_bytes / MIB, 1),
            "mib_hybrid_peak_in_prefill": round(peak_prefill * block_bytes / MIB, 1),
            "ratio": round(held_at_end / all_global, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096,8192,32768")
    parser.add_argument("--budget", type=int, default=2048, help="max-num-batched-tokens: the prefill chunk")
    parser.add_argument("--decode", type=int, default=64)
    args = parser.parse_args()
    for context in (int(c) for c in args.contexts.split(",")):
        print(json.dumps(held_by_one_request(context, args.budget, args.decode)))


if __name__ == "__main__":
    main()
