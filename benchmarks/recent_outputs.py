"""What the suffix method's cache of recent outputs gives a single stream, in process.

An extraction pipeline's requests: the embedded model asked, one request after another, to turn a
sentence about a person into a JSON object with the same six keys (`--requests` sentences built
from fixed lists, greedy, up to 128 tokens). The answers share their layout and keys, which the
prompts hold only in part. Three engines take the requests in turn, request by request (so that
each sees the same machine state): no speculation, the suffix method on each request's own
tokens, and the suffix method with `suffix_decoding_max_cached_requests`. Speculation changes no
token (checked), so the three decode the same tokens; TPOT is decode time over decoded tokens,
the first `--warm` requests excluded (they fill the cache). With `--threads 1` (the default) the
clock is the process's CPU time, immune to a shared machine's descheduling.

`--cache-cost` also times one proposal step against caches of 64 to 10,000 of those answers, for
1 and 16 speculating rows partway through one, and the adding of an output: the price of a
large cache.

    .venv/bin/python -m benchmarks.recent_outputs [--requests 40] [--cached 64] [--cache-cost]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch

from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.speculative.proposers import propose
from vmesh.services.speculative.recent_outputs import RecentOutputs
from vmesh.services.worker.model_runner import WorkerConfig

FIRST = ["Maria", "Tom", "Aiko", "Kwame", "Elena", "Ravi", "Sofia", "Lars", "Amara", "Diego", "Mei", "Jonas"]
LAST = ["Lopez", "Becker", "Tanaka", "Mensah", "Petrova", "Sharma", "Rossi", "Nilsson", "Okafor", "Silva"]
CITIES = ["Madrid", "Hamburg", "Osaka", "Accra", "Sofia", "Pune", "Turin", "Uppsala", "Lagos", "Recife", "Lyon"]
JOBS = ["architect", "baker", "nurse", "engineer", "teacher", "pharmacist", "pilot", "chemist", "lawyer"]
EMPLOYERS = ["City Hospital", "Northwind Foods", "Atlas Aviation", "Blue River School", "Helix Labs", "Orbit Bank"]
INSTRUCTION = ('Extract the person\'s details from this sentence as a JSON object with the keys "name", "age", '
               '"city", "occupation", "employer" and "years_experience": ')


def sentences(count: int) -> list[str]:
    out = []
    for i in range(count):
        name = f"{FIRST[i % len(FIRST)]} {LAST[(i * 7) % len(LAST)]}"
        age, years = 24 + (i * 13) % 40, 1 + (i * 5) % 20
        out.append(f"{name} is a {age}-year-old {JOBS[(i * 5) % len(JOBS)]} in {CITIES[(i * 3) % len(CITIES)]} "
                   f"who has worked at {EMPLOYERS[i % len(EMPLOYERS)]} for {years} years.")
    return out


def decode_time(engine: LLMEngine, prompt: list[int], clock: Callable[[], float]) -> tuple[float, list[int]]:
    """(seconds after the first token, tokens) of one greedy request."""
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=128))
    first_token_at, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first_token_at is None:
                first_token_at = clock()
            tokens += out.new_token_ids
    assert first_token_at is not None
    return clock() - first_token_at, tokens


def single_stream(args: argparse.Namespace) -> dict:
    clock = time.process_time if args.threads == 1 else time.perf_counter
    variants = {"plain": None, "suffix": SpeculativeConfig("suffix", args.k),
                f"suffix+cache{args.cached}": SpeculativeConfig("suffix", args.k,
                                                                suffix_decoding_max_cached_requests=args.cached)}
    engines = {name: LLMEngine.from_config(EngineConfig(worker=WorkerConfig(
        kv_cache_memory=64 << 20, max_num_seqs=4, speculative_config=speculative)))
        for name, speculative in variants.items()}
    plain = engines["plain"]
    prompts = [plain.encode_chat([{"role": "user", "content": INSTRUCTION + text}])
               for text in sentences(args.requests)]
    seconds = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    answers = []
    for i, prompt in enumerate(prompts):
        outputs = {}
        for name, engine in engines.items():
            spent, outputs[name] = decode_time(engine, prompt, clock)
            if i >= args.warm:
                seconds[name] += spent
                tokens[name] += len(outputs[name]) - 1
        assert all(out == outputs["plain"] for out in outputs.values()), f"request {i}: speculation changed tokens"
        answers.append(outputs["plain"])
    results = {}
    for name, engine in engines.items():
        stats = engine.scheduler.spec_stats
        results[name] = {"tpot_ms": 1e3 * seconds[name] / tokens[name],
                         "x_plain": seconds[name] / seconds["plain"],
                         "num_draft_tokens": stats.num_draft_tokens, "num_accepted_tokens": stats.num_accepted_tokens,
                         "acceptance": stats.num_accepted_tokens / max(stats.num_draft_tokens, 1)}
        print(f"{name:16s}: TPOT {results[name]['tpot_ms']:6.2f} ms (x plain {results[name]['x_plain']:.2f}); "
              f"{stats.num_accepted_tokens} of {stats.num_draft_tokens} drafts accepted", flush=True)
        engine.shutdown()
    return {"decoded_tokens": tokens["plain"], "requests_timed": args.requests - args.warm, "variants": results,
            "answers": answers}


def cache_cost(k: int, answers: list[list[int]]) -> list[dict]:
    """Milliseconds of one proposal step against caches of `answers` (the extraction outputs,
    repeated to fill them: every place of `"`, `,` or a newline is a candidate), for 1 and 16
    speculating rows that are partway through such an answer, and of adding one output."""
    rows_out = []
    for cached in (64, 1_000, 10_000):
        cache = RecentOutputs(cached)
        started = time.perf_counter()
        for i in range(cached):
            cache.add(i, np.array(answers[i % len(answers)]))
        add_ms = (time.perf_counter() - started) / cached * 1e3
        config = SpeculativeConfig("suffix", k, suffix_decoding_max_cached_requests=cached)
        for batch in (1, 16):
            seqs = [answers[(3 * r + 1) % len(answers)][:len(answers[(3 * r + 1) % len(answers)]) // 2 + r % 5]
                    for r in range(batch)]
            width = max(map(len, seqs))
            tokens = torch.zeros(batch, width, dtype=torch.int64)
            for r, seq in enumerate(seqs):
                tokens[r, :len(seq)] = torch.tensor(seq)
            lengths = torch.tensor([len(seq) for seq in seqs])
            slots = torch.full((batch,), k)
            timings = {}
            for name, recent in (("with", cache), ("without", None)):
                started = time.perf_counter()
                for _ in range(50):
                    propose(config, tokens, lengths, slots, recent)
                timings[name] = (time.perf_counter() - started) / 50 * 1e3
            rows_out.append({"cached_requests": cached, "rows": batch, "propose_ms": timings["with"],
                             "without_cache_ms": timings["without"], "add_ms": add_ms})
            print(f"cache of {cached:6d} outputs, {batch:2d} rows: propose {timings['with']:6.3f} ms "
                  f"(without the cache {timings['without']:.3f}); adding an output {add_ms:.3f} ms", flush=True)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--warm", type=int, default=8, help="first requests left out of the timing")
    parser.add_argument("--cached", type=int, default=64, help="suffix_decoding_max_cached_requests")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-cost", action="store_true")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, "k": args.k, "single_stream": single_stream(args)}
    answers = result["single_stream"].pop("answers")
    if args.cache_cost:
        result["cache_cost"] = cache_cost(args.k, answers)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
