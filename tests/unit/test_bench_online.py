"""`vmesh bench online`'s loads, its GuideLLM scenarios and figures, and its refusals without the
peers' environments (the runs themselves need them, which CI does not build)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vmesh.services.bench.cli import main
from vmesh.services.bench.guidellm_runs import GuideLLMLoads, benchmark_figures, guidellm_python, guidellm_scenario
from vmesh.services.bench.online_peers import Load, client_runs, parse_variants
from vmesh.services.bench.peers import PeerError

DATA = Path(__file__).resolve().parents[1] / "data"


def test_loads_become_the_clients_flags():
    assert Load.parse("burst:32") == Load("burst:32", math.inf, 32)
    assert Load.parse("burst:32").client_flags() == ["--request-rate", "inf", "--max-concurrency", "32"]
    assert Load.parse("rate:2").client_flags() == ["--request-rate", "2.0"]


def test_every_load_of_every_round_draws_its_own_prompts_which_its_servers_share():
    # One seed throughout repeated the first run's prompts: every later run found them in the
    # server's prefix cache, and the first burst after start-up looked like the slowest (issue 35).
    loads = [Load.parse("burst:32"), Load.parse("rate:2")]
    runs = client_runs(["vmesh", "int8", "vllm"], loads, rounds=3, seed=5)
    seeds: dict[tuple[int, str], set[int]] = {}
    for run in runs:
        seeds.setdefault((run.round_index, run.load.name), set()).add(run.seed)
    assert all(len(shared) == 1 for shared in seeds.values())
    drawn = [seed for shared in seeds.values() for seed in shared]
    assert len(set(drawn)) == len(drawn) == 6
    assert runs[0].seed == 5  # --seed is the first run's
    # The servers' order still alternates from round to round, each load in turn.
    assert [(r.round_index, r.load.name, r.server) for r in runs[:6]] == [
        (0, "burst:32", "vmesh"), (0, "burst:32", "int8"), (0, "burst:32", "vllm"),
        (0, "rate:2", "vmesh"), (0, "rate:2", "int8"), (0, "rate:2", "vllm")]
    assert [r.server for r in runs[6:9]] == ["vllm", "int8", "vmesh"]


@pytest.mark.parametrize("text", ["burst", "burst:x", "rate:fast", "poisson:2"])
def test_a_load_that_is_neither_form_is_refused_by_name(text):
    with pytest.raises(SystemExit, match=f"--loads: '{text}'"):
        Load.parse(text)


def test_without_the_peers_environment_it_says_how_to_build_it(tmp_path):
    with pytest.raises(SystemExit, match="benchmarks/peers/setup.sh"):
        main(["online", "--peers-dir", str(tmp_path), "--out", str(tmp_path)])


def test_variants_are_named_vmesh_servers_with_their_flags():
    assert parse_variants(["nocap=--max-prefill-tokens-with-decodes 0", "plain=--service-niceness 0"]) == {
        "nocap": ["--max-prefill-tokens-with-decodes", "0"], "plain": ["--service-niceness", "0"]}


@pytest.mark.parametrize("text", ["nocap", "=--x", "vllm=--x", "vmesh=--x"])
def test_a_variant_without_a_new_name_is_refused(text):
    with pytest.raises(SystemExit, match=f"--variant: '{text}'"):
        parse_variants([text])


def test_the_guidellm_scenario_sends_the_clients_lengths_to_the_servers_completions(tmp_path):
    loads = GuideLLMLoads(rates=[1.0, 2.0], streams=[1, 32], seconds=90, input_len=256, output_len=128)
    scenario = guidellm_scenario("http://127.0.0.1:8000/v1", "m", tmp_path, loads,
                                 {"kind": "constant", "rate": [1.0, 2.0]}, tmp_path / "out.json")
    spec = scenario["spec"]
    assert spec["backend"] == {"kind": "openai_http", "target": "http://127.0.0.1:8000", "model": "m",
                               "request_format": "/v1/completions"}
    assert spec["data"] == [{"kind": "synthetic_text", "prompt_tokens": 256, "output_tokens": 128}]
    assert spec["constraints"] == [{"kind": "max_duration", "seconds": 90}]
    assert spec["outputs"] == [{"kind": "json", "path": str(tmp_path / "out.json")}]


def test_a_guidellm_benchmark_becomes_one_row_of_figures():
    # A concurrent-32 run of GuideLLM 0.8.1 against vmesh serve, trimmed to the figures read.
    recorded = json.loads((DATA / "guidellm_concurrent32.json").read_text())["benchmarks"][0]
    row = benchmark_figures(recorded)
    assert row["load"] == "32 stream(s)" and row["completed"] == 32
    assert row["output_tok_s"] == pytest.approx(102.4)
    assert row["ttft_p50_ms"] == recorded["metrics"]["time_to_first_token_ms"]["successful"]["median"]
    assert row["itl_p99_ms"] == recorded["metrics"]["inter_token_latency_ms"]["successful"]["percentiles"]["p99"]


def test_without_guidellm_s_environment_it_says_how_to_build_it(tmp_path):
    with pytest.raises(PeerError, match="benchmarks/peers/setup.sh"):
        guidellm_python(tmp_path)
