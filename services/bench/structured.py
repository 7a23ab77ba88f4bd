"""`vmesh bench serving --workload structured`: the standard workload's prompts asked to answer in
JSON, each request constrained by a JSON schema (OpenAI's `response_format`, round-robin over
structured-schemas.json's schemas), against the same prompts unconstrained, in the same run,
through an OpenAI-compatible server's streamed /v1/chat/completions (vmesh's, or vLLM's).

The arms run in turn, constrained first. The unconstrained arm then asks each prompt for exactly
as many tokens as its constrained run produced (`max_tokens` = that count, `ignore_eos`): both
arms decode the same number of tokens per request, so that the throughput ratio measures what
the grammar costs, not how much shorter a JSON answer is than free text. Before each arm a
request per schema (or one plain one) warms the server up: compiling a schema, which servers
cache, is measured on its own, not here; then the arm's first --max-concurrency requests, cut to
2 tokens, at once: a server's first batch that large is its slowest. Throughput compares best
with every request at once (`--request-rate 0`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmesh.services.bench.common import load_workload, machine, reset_prefix_cache
from vmesh.services.bench.mesh import RunningMesh, start_mesh
from vmesh.services.bench.serving import cpu_seconds, serve_load, summarize, timed_openai_stream
from vmesh.services.common.model_loading import resolve_model_dir

STRUCTURED_WORKLOAD = "structured"
SCHEMAS = Path(__file__).resolve().parent / "structured-schemas.json"
ARMS = ("constrained", "unconstrained")
# The standard workload's prompts are ChatML-templated text; the chat API takes their messages.
_CHATML_MESSAGE = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n", re.DOTALL)


@dataclass(frozen=True)
class StructuredPrompt:
    """One request of the workload: chat messages and the schema its answer must follow."""

    messages: tuple[tuple[str, str], ...]  # (role, content)
    schema_name: str
    schema: dict[str, Any]


def chat_messages(templated: str) -> list[tuple[str, str]]:
    """The (role, content) messages of a ChatML prompt, without the open assistant turn it ends with."""
    messages = [(m.group(1), m.group(2)) for m in _CHATML_MESSAGE.finditer(templated)]
    if not messages or messages[-1][0] != "user":
        raise ValueError(f"not a ChatML prompt ending in a user turn: {templated[:120]!r}")
    return messages


def load_structured_workload(requests: int | None, max_tokens: int | None) -> dict[str, Any]:
    """The standard workload's first `requests` prompts, each user turn followed by the instruction
    and given the next schema in turn."""
    standard = load_workload("standard", requests, max_tokens)
    texts = json.loads(standard["path"].read_text())["prompts"][:len(standard["prompts"])]
    spec = json.loads(SCHEMAS.read_text())
    schemas = spec["schemas"]
    prompts = []
    for i, text in enumerate(texts):
        messages = chat_messages(text)
        role, content = messages[-1]
        messages[-1] = (role, f"{content} {spec['instruction']}")
        entry = schemas[i % len(schemas)]
        prompts.append(StructuredPrompt(tuple(messages), entry["name"], entry["schema"]))
    return {"name": STRUCTURED_WORKLOAD, "prompts": prompts, "max_tokens": standard["max_tokens"],
            "schemas": [s["name"] for s in schemas]}


def response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's strict JSON-schema response format."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def chat_body(prompt: StructuredPrompt, max_tokens: int, *, constrained: bool, model: str | None = None,
              ignore_eos: bool = False) -> dict[str, Any]:
    """The body the openai client sends for chat.completions.create(messages=..., max_tokens=...,
    temperature=0, stream=True, stream_options={"include_usage": True}, [response_format=...],
    [extra_body={"ignore_eos": True}]) (vLLM's extra, which vmesh shares)."""
    body: dict[str, Any] = {"messages": [{"role": r, "content": c} for r, c in prompt.messages],
                            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if constrained:
        body["response_format"] = response_format(prompt.schema_name, prompt.schema)
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def arm_bodies(work: dict[str, Any], arm: str, model: str | None,
               matched_tokens: list[int] | None = None) -> list[dict[str, Any]]:
    """Every request of one arm. `matched_tokens`: the unconstrained arm decodes, per prompt, exactly
    the tokens the constrained arm did."""
    if arm == "constrained":
        return [chat_body(p, work["max_tokens"], constrained=True, model=model) for p in work["prompts"]]
    if matched_tokens is None:
        return [chat_body(p, work["max_tokens"], constrained=False, model=model) for p in work["prompts"]]
    return [chat_body(p, max(1, n), constrained=False, model=model, ignore_eos=True)
            for p, n in zip(work["prompts"], matched_tokens, strict=True)]


def warmup_bodies(work: dict[str, Any], arm: str, model: str | None) -> list[dict[str, Any]]:
    """A short request per schema (constrained) or one plain one, sent before an arm's load."""
    firsts = {p.schema_name: p for p in work["prompts"]} if arm == "constrained" else {"": work["prompts"][0]}
    return [chat_body(p, 2, constrained=arm == "constrained", model=model) for p in firsts.values()]


def burst_bodies(bodies: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any]]:
    """The arm's first `concurrency` requests cut to 2 tokens, sent at once before its load: the
    server's first batch that large was measured at 1.6-2.4x a later burst's worker time (the
    cause not established: with fresh prompts benchmarks/first_burst.py finds first-use costs of
    0.2-0.4 % of a burst), which would otherwise fall on whichever arm runs first."""
    return [{**body, "max_tokens": 2} for body in bodies[:max(1, concurrency)]]


def parse_arms(text: str) -> list[str]:
    arms = [a for a in text.split(",") if a]
    if not arms or set(arms) - set(ARMS) or len(set(arms)) != len(arms):
        raise SystemExit(f"vmesh bench serving: --arms takes {' and/or '.join(ARMS)}, got {text!r}")
    return sorted(arms, key=ARMS.index)  # constrained first: the unconstrained arm matches its lengths


def _chat_text(choice: dict[str, Any]) -> str | None:
    return (choice.get("delta") or {}).get("content")


async def _run_arm(bodies: list[dict[str, Any]], warmups: list[dict[str, Any]], args: argparse.Namespace,
                   base_url: str, mesh: RunningMesh | None) -> tuple[list[dict[str, Any]], float, dict[str, float]]:
    import httpx

    url = f"{base_url}/chat/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        for body in warmups:
            await timed_openai_stream(http, url, body, _chat_text)
        await asyncio.gather(*(timed_openai_stream(http, url, body, _chat_text)
                               for body in burst_bodies(bodies, args.max_concurrency or len(bodies))))
        if mesh is not None:
            await reset_prefix_cache(mesh)  # each arm starts cold on the same prompts

        async def send(body: dict[str, Any], _max_tokens: int) -> dict[str, Any]:
            return await timed_openai_stream(http, url, body, _chat_text)

        before = cpu_seconds(mesh)
        results, elapsed = await serve_load([send] * len(bodies), bodies, 0, args.request_rate,
                                            args.max_concurrency, args.seed)
        after = cpu_seconds(mesh)
    return results, elapsed, {name: after[name] - before[name] for name in before if name in after}


def _answers(results: list[dict[str, Any]]) -> dict[str, Any]:
    """How the answers ended and how many parse as JSON (schema validation is the tests' job)."""
    parsed = 0
    for r in results:
        with contextlib.suppress(ValueError):
            json.loads(r["text"])
            parsed += 1
    return {"json_parsed": parsed, "finish_reasons": dict(Counter(str(r["finish_reason"]) for r in results))}


def ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Constrained over unconstrained, for each throughput figure; empty unless both arms ran."""
    if set(ARMS) - set(summaries):
        return {}
    c, u = summaries["constrained"], summaries["unconstrained"]
    return {key: c[key] / u[key] for key in ("output_token_throughput", "request_throughput") if u[key]}


def serving_structured(args: argparse.Namespace) -> dict[str, Any]:
    """Each arm of the structured workload in turn, through --base-url or a mesh started here."""
    if args.address or (args.backend or "openai") != "openai" or args.interleave:
        raise SystemExit("vmesh bench serving: --workload structured runs through the OpenAI chat API "
                         "(--backend openai, no --address or --interleave)")
    arms = parse_arms(args.arms)
    work = load_structured_workload(args.num_requests, args.max_tokens)
    model = args.model if args.base_url else None  # --model: a name for a server we did not start
    mesh = None if args.base_url else start_mesh("--model", str(resolve_model_dir(args.model)),
                                                 "--kv-cache-memory", args.kv_cache_memory)
    base_url = (args.base_url or (mesh.http_url if mesh else "")).rstrip("/")
    summaries: dict[str, dict[str, Any]] = {}
    matched: list[int] | None = None
    try:
        for arm in arms:
            bodies = arm_bodies(work, arm, model, matched)
            results, elapsed, cpu = asyncio.run(_run_arm(bodies, warmup_bodies(work, arm, model), args, base_url,
                                                         mesh))
            tokens = max(1, sum(r["tokens"] for r in results))
            summaries[arm] = {**summarize(results, elapsed, args), **_answers(results),
                              "cpu_ms_per_token": {k: 1e3 * v / tokens for k, v in cpu.items()}}
            if arm == "constrained":
                matched = [r["tokens"] for r in results]
    finally:
        if mesh is not None:
            mesh.stop()
    result: dict[str, Any] = {"mode": "serving", "workload": STRUCTURED_WORKLOAD, **machine(),
                              "schemas": work["schemas"], "request_rate": args.request_rate,
                              "max_concurrency": args.max_concurrency, "max_tokens": work["max_tokens"],
                              "matched_lengths": matched is not None and "unconstrained" in summaries,
                              "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
                              "arms": summaries, "constrained_over_unconstrained": ratios(summaries)}
    for arm, s in summaries.items():
        print(f"[{arm}] {s['num_requests']} requests in {s['duration_s']:.1f} s: {s['request_throughput']:.2f} req/s, "
              f"{s['output_token_throughput']:.1f} tokens/s; JSON parsed {s['json_parsed']}/{s['num_requests']}, "
              f"finish {s['finish_reasons']}")
    for key, value in result["constrained_over_unconstrained"].items():
        print(f"constrained / unconstrained {key}: {value:.3f}")
    return result
