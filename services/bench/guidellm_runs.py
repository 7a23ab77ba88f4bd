"""GuideLLM (the vLLM project's load generator) against the servers `vmesh bench online` started:
a sweep over fixed loads — one stream (its synchronous point), Poisson-free constant arrival
rates, and N concurrent streams (its saturation point) — each load for a fixed time, on
synthetic prompts of the client's lengths, EOS ignored. GuideLLM's own `sweep` profile picks its
rates from each server's measured extremes, so two servers would meet different loads; fixed
rates give both the same ones. It runs from its own environment under the peers directory
(`benchmarks/peers/setup.sh` builds it), as scenario files, and imports nothing of vmesh."""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmesh.services.bench.peers import PeerError

GUIDELLM_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class GuideLLMLoads:
    rates: list[float]  # constant arrivals, requests per second
    streams: list[int]  # concurrent streams (1: the synchronous point)
    seconds: float  # each load's duration
    input_len: int
    output_len: int


def guidellm_python(peers_dir: Path) -> Path:
    python = peers_dir / "guidellm" / "bin" / "python"
    if not python.is_file():
        raise PeerError(f"--guidellm-rates needs GuideLLM's environment {python.parent.parent}: build it once with "
                        f"`bash benchmarks/peers/setup.sh {peers_dir}`")
    return python


def guidellm_scenario(base_url: str, model: str, tokenizer: Path, loads: GuideLLMLoads, profile: dict[str, Any],
              output: Path) -> dict[str, Any]:
    return {"metadata": {"name": f"vmesh-bench-{profile['kind']}"},
            "spec": {"backend": {"kind": "openai_http", "target": base_url.removesuffix("/v1"), "model": model,
                                 "request_format": "/v1/completions"},
                     "profile": profile,
                     "constraints": [{"kind": "max_duration", "seconds": loads.seconds}],
                     "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
                     "data": [{"kind": "synthetic_text", "prompt_tokens": loads.input_len,
                               "output_tokens": loads.output_len}],
                     "outputs": [{"kind": "json", "path": str(output)}]}}


def benchmark_figures(benchmark: dict[str, Any]) -> dict[str, Any]:
    """One load's row: what it was, and the figures `vmesh bench online` compares."""
    metrics, strategy = benchmark["metrics"], benchmark["config"]["strategy"]
    load = (f"{strategy['max_concurrency']} stream(s)" if strategy["type_"] in ("synchronous", "concurrent")
            else f"{strategy.get('rate')} req/s")

    def stat(name: str, key: str) -> float:
        return float(metrics[name]["successful"][key] if key in ("mean", "median")
                     else metrics[name]["successful"]["percentiles"][key])

    return {"load": load, "completed": int(metrics["request_totals"]["successful"]),
            "requests_per_s": stat("requests_per_second", "mean"),
            "output_tok_s": stat("output_tokens_per_second", "mean"),
            "ttft_p50_ms": stat("time_to_first_token_ms", "median"),
            "ttft_p99_ms": stat("time_to_first_token_ms", "p99"),
            "itl_p50_ms": stat("inter_token_latency_ms", "median"),
            "itl_p99_ms": stat("inter_token_latency_ms", "p99")}


def run_guidellm(python: Path, base_url: str, model: str, tokenizer: Path, loads: GuideLLMLoads) -> list[dict]:
    """Every load of `loads` against one server, in order: streams, then rates."""
    profiles = [{"kind": "concurrent", "streams": loads.streams}] if loads.streams else []
    profiles += [{"kind": "constant", "rate": loads.rates}] if loads.rates else []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="vmesh-bench-guidellm-") as out:
        for index, profile in enumerate(profiles):
            result, scenario = Path(out) / f"result-{index}.json", Path(out) / f"scenario-{index}.json"
            scenario.write_text(json.dumps(guidellm_scenario(base_url, model, tokenizer, loads, profile, result)))
            done = subprocess.run([str(python), "-m", "guidellm", "run", "--scenario", str(scenario),
                                   "--disable-console-interactive"], capture_output=True, text=True,
                                  timeout=GUIDELLM_TIMEOUT_S)
            if done.returncode != 0 or not result.exists():
                raise PeerError(f"GuideLLM failed against {base_url}:\n{(done.stdout + done.stderr)[-3000:]}")
            rows += [benchmark_figures(b) for b in json.loads(result.read_text())["benchmarks"]]
    return rows
