"""Every `vmesh bench` mode end to end on a tiny configuration: the JSON has every field.
No timing is asserted."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.checkout import ROOT
from vmesh.services.bench.claims import tiny_model_dir
from vmesh.services.bench.common import load_workload


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def bench(out, *args) -> dict:
    memory = [] if "--kv-cache-memory" in args else ["--kv-cache-memory", "64MiB"]
    done = subprocess.run([sys.executable, "-m", "vmesh", "bench", *args, "--out", str(out), *memory],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    workload = args[args.index("--workload") + 1] if "--workload" in args else "standard"
    name = args[0] if workload == "standard" else f"{args[0]}-{workload}"
    return json.loads((out / f"{name}.json").read_text())


def positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_offline(tmp_path, tiny_model):
    r = bench(tmp_path, "offline", "--model", str(tiny_model), "--requests", "3", "--max-tokens", "4",
              "--repeats", "2", "--baselines", "transformers,engine,mesh,mesh-final")
    assert set(r["tokens_per_s"]) == set(r["runs_tokens_per_s"]) == {"transformers", "engine", "mesh", "mesh-final"}
    assert all(positive(v) for v in r["tokens_per_s"].values())
    assert all(len(runs) == 2 and all(positive(v) for v in runs) for runs in r["runs_tokens_per_s"].values())
    assert r["ratio_to_mesh"]["mesh"] == pytest.approx(1.0)
    assert positive(r["latency"]["ttft_ms"]) and positive(r["latency"]["mean_itl_ms"])
    # The in-process engine's single request, timed as the peers' runner times theirs (its ITL is
    # a difference of two wall times over 3 tokens here: a number, not asserted positive).
    engine = r["engine_latency"]["engine"]
    assert set(r["engine_latency"]) == {"engine"} and positive(engine["ttft_ms"]) and positive(engine["cached_ttft_ms"])
    assert isinstance(engine["mean_itl_ms"], float)
    assert 0 < r["mesh_duty_cycle"] <= 1
    assert set(r["mesh_peak_pss_mib"]) == {"worker", "detokenizer-0", "scheduler", "frontend"}
    assert all(positive(v) for v in r["mesh_peak_pss_mib"].values())
    assert r["command"].startswith("vmesh bench offline") and r["date"]
    assert r["workload"] == "standard"
    assert r["prompt_tokens"] == sum(len(p) for p in load_workload("standard", 3, 4)["prompts"])


def test_offline_long_workload_reports_prompt_rate_and_uncached_ttft(tmp_path):
    """Two of the long workload's 2,000-token prompts through the mesh, float32 and with the GGUF's
    own blocks, and through the in-process engine on those blocks, on the embedded model whose
    tokenizer made them."""
    r = bench(tmp_path, "offline", "--workload", "long", "--requests", "2", "--max-tokens", "3",
              "--baselines", "mesh,mesh-native,engine-native", "--kv-cache-memory", "256MiB")
    assert r["workload"] == "long" and r["requests"] == 2 and r["prompt_tokens"] == 4000
    assert r["prompt_tokens_per_s"]["mesh"] == pytest.approx(r["tokens_per_s"]["mesh"] * 4000 / 6)
    assert positive(r["latency"]["ttft_ms"]) and positive(r["latency"]["cached_ttft_ms"])
    assert set(r["tokens_per_s"]) == {"mesh", "mesh-native", "engine-native"}
    assert positive(r["tokens_per_s"]["mesh-native"]) and positive(r["tokens_per_s"]["engine-native"])
    assert positive(r["variant_latency"]["mesh-native"]["mean_itl_ms"])
    assert positive(r["engine_latency"]["engine-native"]["ttft_ms"])
    assert r["mesh_peak_pss_mib"]["mesh-native/worker"] < r["mesh_peak_pss_mib"]["worker"]


def test_offline_counts_the_drafts_of_a_speculative_mesh(tmp_path):
    """Two overlap prompts (the embedded model quoting a passage) through the mesh with n-gram
    speculation: the report carries the scheduler's draft counters for the workload's rounds and
    for the single request, and most drafts are accepted; the plain mesh reports none."""
    r = bench(tmp_path, "offline", "--workload", "overlap", "--requests", "2", "--max-tokens", "24",
              "--baselines", "mesh,mesh-spec", "--kv-cache-memory", "128MiB")
    assert set(r["mesh_drafts"]) == {"mesh-spec"}
    drafts = r["mesh_drafts"]["mesh-spec"]
    assert drafts["num_draft_tokens"] > 0 and 2 * drafts["num_accepted_tokens"] >= drafts["num_draft_tokens"]
    single = r["variant_latency"]["mesh-spec"]
    assert 0 < single["num_accepted_tokens"] <= single["num_draft_tokens"]
    assert r["latency"]["num_draft_tokens"] == 0


def test_unknown_workload_is_refused_by_name(tmp_path):
    done = subprocess.run([sys.executable, "-m", "vmesh", "bench", "offline", "--workload", "longest"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no workload 'longest'" in done.stderr and "long" in done.stderr


def test_serving(tmp_path, tiny_model):
    r = bench(tmp_path, "serving", "--model", str(tiny_model), "--num-requests", "6", "--max-tokens", "4",
              "--request-rate", "20", "--max-concurrency", "3", "--dtype", "bfloat16",
              "--serve-flags", "--service-niceness 5", "--engine-reference")
    assert (r["dtype"], r["weights"], r["mesh_only_flags"]) == ("bfloat16", None, ["--service-niceness", "5"])
    assert set(r["backends"]) == {"grpc", "engine"}
    for summary in r["backends"].values():
        for name in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(summary[name]) == {"p50", "p90", "p99", "mean"}
        assert summary["num_requests"] == 6
        assert positive(summary["request_throughput"]) and positive(summary["output_token_throughput"])
        assert 0 <= summary["goodput_requests_per_s"] <= summary["request_throughput"]
        assert 0 < summary["steps"]["worker_busy_fraction"] <= 1


def test_serving_refuses_mesh_flags_for_a_server_it_did_not_start():
    done = subprocess.run([sys.executable, "-m", "vmesh", "bench", "serving", "--address", "127.0.0.1:9",
                           "--serve-flags=--no-internal-tls"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "configure a mesh it starts" in done.stderr


def test_serving_grpc_and_openai_backends_in_turn(tmp_path, tiny_model):
    r = bench(tmp_path, "serving", "--model", str(tiny_model), "--num-requests", "4", "--max-tokens", "4",
              "--request-rate", "0", "--backend", "grpc,openai")
    assert set(r["backends"]) == {"grpc", "openai"} and not r["interleaved"]
    for summary in r["backends"].values():
        assert summary["num_requests"] == 4 and positive(summary["output_token_throughput"])
        assert set(summary["ttft_ms"]) == {"p50", "p90", "p99", "mean"}
        assert {"client", "frontend", "scheduler", "worker", "detokenizer-0"} <= set(summary["cpu_ms_per_token"])
        assert positive(summary["cpu_ms_per_token"]["worker"])


def test_serving_interleaved_splits_one_load_between_backends(tmp_path, tiny_model):
    r = bench(tmp_path, "serving", "--model", str(tiny_model), "--num-requests", "5", "--max-tokens", "4",
              "--request-rate", "0", "--backend", "grpc,openai", "--interleave")
    assert r["interleaved"] and set(r["backends"]) == {"grpc", "openai"}
    assert sorted(s["num_requests"] for s in r["backends"].values()) == [2, 3]
    assert r["backends"]["grpc"]["duration_s"] == r["backends"]["openai"]["duration_s"]  # one load
    assert all("cpu_ms_per_token" not in s for s in r["backends"].values())


def test_claims(tmp_path):
    r = bench(tmp_path, "claims", "--models", "tiny", "--requests", "3", "--max-tokens", "4")
    modes = r["models"]["tiny"]["modes"]
    assert set(modes) == {"depth1-stateful", "depth1-stateless", "depth2-stateful", "depth2-stateless"}
    for m in modes.values():
        assert 0 < m["duty_cycle"] <= 1 and positive(m["bytes_per_decode_step"]) and positive(m["tokens_per_s"])
    # Resending every request in full costs more bytes than the stateful diff: always, not a timing.
    assert r["models"]["tiny"]["bytes_stateless_over_stateful"] > 1


def test_detokenizer(tmp_path):
    r = bench(tmp_path, "detokenizer", "--requests", "4", "--max-tokens", "5", "--replicas", "1", "2")
    assert set(r["tokens_per_s"]) == {"1", "2"} and all(positive(v) for v in r["tokens_per_s"].values())


@pytest.mark.parametrize("flags", [[], ["--attention-backend", "torch", "--no-small-batch-linear", "--profile"]])
def test_decode_step_script_runs(flags):
    done = subprocess.run([sys.executable, "-m", "benchmarks.decode_step", "--batch", "2", "--context", "20",
                           "--steps", "2", *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    backend = "torch" if flags else "cpu"
    summary = rf"batch 2, context 20, attention {backend}, \d+ threads: [\d.]+ ms/step"
    assert re.search(summary, done.stdout), done.stdout
    assert ("Self CPU time total" in done.stdout) == bool(flags)


def test_batch_linear_bf16_script_runs_or_says_why_not():
    """The C / oneDNN comparison of bfloat16 products: a row per layer where the kernel runs, else
    the one-line reason (no AVX-512 BF16, or AMX's packed layout) and a nonzero exit."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.batch_linear_bf16", "--rows", "8", "--rounds", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode:
        assert "AVX-512 BF16" in done.stderr or "AMX" in done.stderr, done.stdout + done.stderr
        return
    rows = re.findall(r"^\s+(qkv|o|gate_up|down|lm_head)\s+8\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+$", done.stdout, re.M)
    assert sorted(rows) == sorted(["qkv", "o", "gate_up", "down", "lm_head"]), done.stdout
