"""Builds `services/bench/long-16x2000.json`, the long-context benchmark workload: 16 distinct
prompts of exactly 2,000 tokens of the embedded model's tokenizer, no two sharing a first
KV block, 64 greedy output tokens each with EOS ignored.

The prompts are made of this repository's own prose (README.md and docs/architecture.md):
prompt i opens with a paragraph of its own, then the others in an order shuffled with
seed i, cut to length and followed by an instruction. The result is committed, so the
workload stays fixed when the docs change; run this again only to make a new workload (and give it a new name).

    .venv/bin/python -m benchmarks.make_long_workload
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from vmesh.services.common.model_loading import load_tokenizer, resolve_model_dir

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["README.md", "docs/architecture.md"]
INSTRUCTION = "\n\nSummarize the notes above in one paragraph for a new engineer:\n"
BLOCK = 16  # distinct first blocks: no prefix-cache hit between prompts


def paragraphs() -> list[str]:
    text = "\n\n".join((ROOT / name).read_text() for name in SOURCES)
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]


def build(requests: int, prompt_tokens: int, max_tokens: int) -> dict:
    tokenizer = load_tokenizer(resolve_model_dir(None))
    pool = paragraphs()
    tail = tokenizer(INSTRUCTION, add_special_tokens=False)["input_ids"]
    prompts = []
    # Each prompt opens with a different paragraph; the rest follow in an order of its own.
    openers = random.Random(0).sample(range(len(pool)), requests + 1)
    for seed, opener in enumerate(openers):  # one more than requests: the latency case
        order = pool[:opener] + pool[opener + 1:]
        random.Random(seed).shuffle(order)
        order.insert(0, pool[opener])
        ids = tokenizer("\n\n".join(order), add_special_tokens=False)["input_ids"]
        if len(ids) < prompt_tokens:
            raise SystemExit(f"the sources hold {len(ids)} tokens, fewer than {prompt_tokens}")
        prompts.append(ids[:prompt_tokens - len(tail)] + tail)
    first_blocks = {tuple(p[:BLOCK]) for p in prompts}
    if len(first_blocks) != len(prompts):
        raise SystemExit("two prompts share their first block; change the seeds")
    return {
        "description": (f"Long-context benchmark workload for the embedded SmolLM2-135M-Instruct: {requests} distinct "
                        f"prompts of exactly {prompt_tokens} tokens (this repository's README and architecture "
                        "notes, paragraphs shuffled per prompt, then an instruction), no two sharing a first "
                        f"KV block; greedy, exactly {max_tokens} output tokens each with EOS ignored; plus one "
                        "more prompt of the same kind for single-request latency. Built by "
                        "benchmarks/make_long_workload.py; engines should consume the token ids."),
        "n_requests": requests,
        "max_new_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "prompt_token_ids": prompts[:requests],
        "latency_prompt_token_ids": prompts[requests],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    out = ROOT / "services" / "bench" / f"long-{args.requests}x{args.prompt_tokens}.json"
    workload = build(args.requests, args.prompt_tokens, args.max_tokens)
    # One prompt per line: a reviewable diff, a file of ~200 kB.
    lines = [json.dumps({k: v for k, v in workload.items() if not k.endswith("token_ids")}, indent=1)[:-2] + ","]
    lines.append('"prompt_token_ids": [')
    lines.append(",\n".join(json.dumps(p, separators=(",", ":")) for p in workload["prompt_token_ids"]) + "],")
    latency = json.dumps(workload["latency_prompt_token_ids"], separators=(",", ":"))
    lines.append(f'"latency_prompt_token_ids": {latency}')
    lines.append("}")
    out.write_text("\n".join(lines) + "\n")
    json.loads(out.read_text())
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
