"""`vmesh bench online`: vLLM's own serving benchmark client (`vllm bench serve`, run from the
peers' vLLM environment) against `vmesh serve` and against vLLM's OpenAI server, on the same
converted weights, in the same precision, under the same loads. Both servers are started once
and stay up; each round sends every load to each of them, the order of the servers swapped from
round to round, so that the machine's drift (±20 % between sittings here) falls on both alike.
Every load of every round draws its own prompts (the servers of that load and round share them):
repeated prompts would find the previous run's prefix cache, and make every run after the
first faster than the first. Medians over the rounds are reported, with vmesh's figures over
vLLM's."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vmesh.services.bench.common import machine
from vmesh.services.bench.guidellm_runs import GuideLLMLoads, guidellm_python, run_guidellm
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.bench.peers import READY_TIMEOUT_S, PeerError, default_peers_dir, peer_environment, peer_python
from vmesh.services.common.model_loading import resolve_model_dir
from vmesh.services.launcher import free_port

CLIENT = Path(__file__).resolve().parent / "vllm_client.py"
SERVERS = ("vmesh", "vllm")
# What the client reports that the comparison reads: throughput, and latency means and percentiles.
FIGURES = ("completed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
           "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms")
# Figure -> whether more is better, for the ratios of vmesh over vLLM.
RATIOS = {"output_throughput": True, "median_ttft_ms": False, "mean_tpot_ms": False, "p99_itl_ms": False}
CLIENT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Load:
    """`burst:N`: every request at once, N in flight at most; `rate:R`: Poisson arrivals, R per second."""
    name: str
    request_rate: float
    max_concurrency: int | None

    @classmethod
    def parse(cls, text: str) -> Load:
        kind, _, value = text.partition(":")
        if kind == "burst" and value.isdigit():
            return cls(text, math.inf, int(value))
        if kind == "rate":
            with contextlib.suppress(ValueError):
                return cls(text, float(value), None)
        raise SystemExit(f"--loads: {text!r} is neither burst:N nor rate:R")

    def client_flags(self) -> list[str]:
        flags = ["--request-rate", "inf" if math.isinf(self.request_rate) else str(self.request_rate)]
        return flags + (["--max-concurrency", str(self.max_concurrency)] if self.max_concurrency else [])


def _served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/models", timeout=10) as reply:
        return json.load(reply)["data"][0]["id"]


class VllmServer:
    """vLLM's OpenAI server on loopback, in a session of its own (its engine runs in children)."""

    def __init__(self, python: Path, model_dir: Path, dtype: str, port: int, max_model_len: int,
                 kv_cache_bytes: int):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vmesh-bench-vllm-server-", suffix=".log",  # noqa: SIM115
                                               delete=False)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        baseline = "vllm-bf16" if dtype == "bfloat16" else "vllm"
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--dtype", dtype, "--max-model-len", str(max_model_len), "--host", "127.0.0.1",
                   "--port", str(port), "--seed", "0"]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=peer_environment(baseline, python, torch.get_num_threads(),
                                                             kv_cache_bytes))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError):
                self.model = _served_model(self.base_url)
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise PeerError(f"vLLM's server did not start (log {self.log.name})")
            time.sleep(1.0)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


@dataclass(frozen=True)
class ClientRun:
    round_index: int
    load: Load
    server: str
    seed: int  # vLLM's client's: it draws the run's random prompts from it


def client_runs(servers: list[str], loads: list[Load], rounds: int, seed: int) -> list[ClientRun]:
    """The order of the client's runs: round after round, each load in turn, the servers in an
    order reversed every other round. Every load of every round has its own seed, shared by its
    servers: one seed throughout gave every run the first one's prompts, so each server's first
    burst computed all of its prefill and every later run found it in the prefix cache (vmesh:
    240 of each 256-token prompt; benchmarks/first_burst.py)."""
    runs = []
    for round_index in range(rounds):
        order = servers if round_index % 2 == 0 else servers[::-1]
        for load_index, load in enumerate(loads):
            runs += [ClientRun(round_index, load, server, seed + round_index * len(loads) + load_index)
                     for server in order]
    return runs


def run_client(python: Path, base_url: str, model: str, tokenizer: Path, load: Load, seed: int,
               args: argparse.Namespace) -> dict[str, float]:
    """One load against one server: vLLM's client on random prompts of fixed lengths drawn from
    `seed`, EOS ignored."""
    with tempfile.TemporaryDirectory(prefix="vmesh-bench-vllm-client-") as out:
        command = [str(python), str(CLIENT), "--backend", "openai", "--base-url", base_url.removesuffix("/v1"),
                   "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer),
                   "--dataset-name", "random", "--random-input-len", str(args.input_len),
                   "--random-output-len", str(args.output_len), "--ignore-eos", "--num-prompts",
                   str(args.num_prompts), "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
                   "--metric-percentiles", "50,99", "--num-warmups", str(args.num_warmups), "--disable-tqdm",
                   "--save-result", "--result-dir", out,
                   "--result-filename", "result.json", *load.client_flags()]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=CLIENT_TIMEOUT_S)
        if done.returncode != 0:
            raise PeerError(f"vLLM's benchmark client failed against {base_url}:\n{done.stderr[-3000:]}")
        result = json.loads((Path(out) / "result.json").read_text())
    figures = {name: float(result[name]) for name in FIGURES if name in result}
    if figures.get("completed") != args.num_prompts:
        raise PeerError(f"{base_url}: {figures.get('completed')} of {args.num_prompts} requests completed")
    return figures


def parse_variants(texts: list[str]) -> dict[str, list[str]]:
    """`NAME=FLAGS` (flags as a shell would split them): another vmesh serve, started with FLAGS
    beside the default one's, that joins the alternation as server NAME."""
    variants: dict[str, list[str]] = {}
    for text in texts:
        name, equals, flags = text.partition("=")
        if not equals or not name or name in SERVERS or name in variants:
            raise SystemExit(f"--variant: {text!r} is not NAME=FLAGS with a new NAME (not {', '.join(SERVERS)})")
        variants[name] = shlex.split(flags)
    return variants


def _ratios(medians: dict[str, dict[str, dict[str, float]]], over: str, loads: list[Load]) -> dict[str, Any]:
    return {load.name: {name: medians[server][load.name][name] / medians[over][load.name][name] for name in RATIOS}
            for load in loads for server in medians if server != over} if over in medians else {}


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(r[name] for r in runs) for name in runs[0]}


def online(args: argparse.Namespace) -> dict[str, Any]:
    peers_dir = Path(args.peers_dir) if args.peers_dir else default_peers_dir()
    loads = [Load.parse(text) for text in args.loads.split(",")] if args.rounds else []  # 0: GuideLLM only
    guidellm = _guidellm_loads(args)
    try:
        python = peer_python(peers_dir, "vllm")
        guidellm_interpreter = guidellm_python(peers_dir) if guidellm else None
    except PeerError as exc:
        raise SystemExit(str(exc)) from exc
    model_dir = resolve_model_dir(args.model)
    meshes = {"vmesh": [], **parse_variants(args.variant)}
    servers = [*meshes, *(["vllm"] if not args.no_vllm else [])]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {s: {load.name: [] for load in loads} for s in servers}
    urls: dict[str, str] = {}
    sweeps: dict[str, list[dict]] = {}
    with contextlib.ExitStack() as stack:
        for name, flags in meshes.items():
            mesh = start_mesh("--model", str(model_dir), "--kv-cache-memory", args.kv_cache_memory,
                              "--dtype", args.dtype, *flags)
            stack.callback(mesh.stop)
            urls[name] = mesh.http_url
        if not args.no_vllm:
            vllm = VllmServer(python, model_dir, args.dtype, free_port(), args.input_len + args.output_len + 64,
                              args.kv_cache_memory_bytes)
            stack.callback(vllm.close)
            urls["vllm"] = vllm.base_url
        models = {name: _served_model(url) for name, url in urls.items()}
        for run in client_runs(servers, loads, args.rounds, args.seed):
            figures = run_client(python, urls[run.server], models[run.server], model_dir, run.load, run.seed, args)
            runs[run.server][run.load.name].append(figures)
            print(f"round {run.round_index + 1} {run.load.name} {run.server}: {figures['output_throughput']:.1f} "
                  f"tok/s, TTFT p50 {figures['median_ttft_ms']:.0f} ms, TPOT {figures['mean_tpot_ms']:.1f} ms, "
                  f"ITL p99 {figures['p99_itl_ms']:.0f} ms", flush=True)
        if guidellm and guidellm_interpreter:
            for server in servers:  # after every round of vLLM's client, on the same servers
                sweeps[server] = run_guidellm(guidellm_interpreter, urls[server], models[server], model_dir, guidellm)
                for row in sweeps[server]:
                    print(f"guidellm {server} {row['load']}: {row['output_tok_s']:.1f} tok/s, TTFT p50 "
                          f"{row['ttft_p50_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms, p99 "
                          f"{row['itl_p99_ms']:.0f} ms", flush=True)
    medians = {s: {load: _medians(r) for load, r in per_load.items()} for s, per_load in runs.items()}
    vmesh_medians = {"vmesh": medians["vmesh"], **({"vllm": medians["vllm"]} if "vllm" in medians else {})}
    return {"machine": machine(), "dtype": args.dtype, "rounds": args.rounds, "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len, "variants": dict(meshes), "runs": runs,
            "medians": medians, "vmesh_over_vllm": _ratios(vmesh_medians, "vllm", loads),
            "variants_over_vmesh": {name: _ratios({name: medians[name], "vmesh": medians["vmesh"]}, "vmesh", loads)
                                    for name in meshes if name != "vmesh"},
            **({"guidellm": {"loads": vars(guidellm), "servers": sweeps}} if guidellm else {})}


def _guidellm_loads(args: argparse.Namespace) -> GuideLLMLoads | None:
    if not args.guidellm_rates:
        return None
    try:
        rates = [float(r) for r in args.guidellm_rates.split(",")]
        streams = [int(s) for s in args.guidellm_streams.split(",")] if args.guidellm_streams else []
    except ValueError:
        raise SystemExit("--guidellm-rates / --guidellm-streams: comma-separated numbers") from None
    return GuideLLMLoads(rates, streams, args.guidellm_seconds, args.input_len, args.output_len)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers-dir", default=None,
                        help="where benchmarks/peers/setup.sh built the peers' environments "
                             "(default: $VMESH_PEERS_DIR, else ~/.cache/vmesh-peers)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="both servers' precision (default: bfloat16, both servers' best mode here)")
    parser.add_argument("--loads", default="burst:32,rate:2",
                        help="comma-separated: burst:N (all at once, N in flight) and rate:R (Poisson, R/s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of vLLM's client over every load and server (0: only the GuideLLM sweep)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="another vmesh serve with these extra flags, alternated with the others as NAME "
                             "(repeatable), e.g. nocap='--max-prefill-tokens-with-decodes 0'")
    parser.add_argument("--no-vllm", action="store_true", help="only the vmesh servers (e.g. to compare variants)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0,
                        help="the first round's first load's prompts; each later load and round draws from the next "
                             "seed, so that no run finds the prompts of another in a prefix cache")
    parser.add_argument("--num-warmups", type=int, default=8,
                        help="requests each client run sends first (all of them its first prompt) and leaves out "
                             "of its figures: the servers' first-use costs fall outside the rounds")
    parser.add_argument("--guidellm-rates", default="",
                        help="also a GuideLLM sweep over these constant rates (comma-separated requests/s) against "
                             "every server, after the rounds, e.g. 0.5,1,2,3 (needs setup.sh's guidellm environment)")
    parser.add_argument("--guidellm-streams", default="1,32",  # as vLLM's client's burst
                        help="with --guidellm-rates: the sweep's concurrent-stream loads (1: its synchronous point)")
    parser.add_argument("--guidellm-seconds", type=float, default=90.0,
                        help="each GuideLLM load's duration (long enough that every stream completes requests)")
