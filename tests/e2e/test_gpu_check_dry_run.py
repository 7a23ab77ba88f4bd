"""tools/gpu_check.sh --dry-run: the GPU check's every section on this CPU machine at its smallest
sizes (the kernels through the Triton interpreter, the bench commands checked by `vmesh bench`'s
parser), so that the script and its wheel list stay in step with the code they run on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.checkout import ROOT
from tools import gpu_wheels
from tools.gpu_check import SECTIONS, THROUGHPUT_BASELINES


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run([str(ROOT / "tools" / "gpu_check.sh"), "--dry-run", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)
    log = (out / "gpu_check.log").read_text()
    assert done.returncode == 0, log[-6000:]
    return json.loads((out / "gpu_check.json").read_text()), log


def test_every_section_runs_or_is_planned(dry_run):
    result, log = dry_run
    assert result["dry_run"] and result["device"] == "cpu"
    statuses = {name: section["status"] for name, section in result["sections"].items()}
    assert statuses == {**dict.fromkeys(SECTIONS, "passed"), "throughput": "planned", "claims": "planned"}
    assert result["summary"]["statuses"] == statuses
    assert "cover vmesh's runtime on the GPU machine" in log  # gpu_wheels.py --check ran first
    assert all(f"[gpu_check] {name}: {statuses[name]}" in log for name in SECTIONS)


def test_kernels_are_checked_in_both_dtypes(dry_run):
    kernels = dry_run[0]["sections"]["kernels"]
    assert kernels["failures"] == 0 and kernels["cases"] == len(kernels["rows"])
    assert {(r["kernel"], r["dtype"]) for r in kernels["rows"]} >= {
        ("unified_attention", "float32"), ("split_kv_decode_attention", "float32"), ("rms_norm", "float32"),
        ("write_kv", "bfloat16"), ("silu_and_mul", "bfloat16")}
    assert all(r["max_abs_error"] <= r["tolerance"] for r in kernels["rows"])


def test_models_match_transformers_and_the_mesh_survives_a_worker_kill(dry_run):
    sections = dry_run[0]["sections"]
    tiny, embedded, serve = sections["engine_tiny"], sections["engine_embedded"], sections["serve"]
    assert tiny["float32_equal"] == tiny["requests_per_dtype"] > 0
    assert {r["dtype"] for r in tiny["rows"]} == {"float32", "bfloat16"}
    assert embedded["equal"] == embedded["requests"] > 0 and "embedded model" in embedded["model"]
    assert embedded["seeded_sampling_repeats"]
    assert serve["grpc_equal"] == serve["requests"] > 0
    assert serve["http_status"] == 200 and serve["http_text_equals_grpc"]
    assert serve["worker_restarts"] == 1 and serve["equal_after_kill_between_requests"]
    assert serve["stop_exit_code"] == 0


def test_bench_commands_are_the_ones_the_gpu_runs(dry_run):
    sections = dry_run[0]["sections"]
    offline = sections["throughput"]["offline"]
    assert offline["command"][:3] == ["bench", "offline", "--baselines"] and THROUGHPUT_BASELINES in offline["command"]
    assert sections["throughput"]["transformers_single_request"]["ttft_ms"] > 0
    claims = sections["claims"]["models"]
    assert set(claims) == {"embedded", "tiny"}
    assert all(c["status"] == "planned" and c["command"][:2] == ["bench", "claims"] for c in claims.values())


def write_list(tmp_path, monkeypatch, edit) -> None:
    lines = gpu_wheels.WHEEL_LIST.read_text().splitlines()
    listed = tmp_path / "gpu_wheels.txt"
    listed.write_text("\n".join(edit(lines)) + "\n")
    monkeypatch.setattr(gpu_wheels, "WHEEL_LIST", listed)


def test_wheel_list_check_names_a_missing_requirement(tmp_path, monkeypatch):
    write_list(tmp_path, monkeypatch, lambda lines: [line for line in lines if not line.startswith("pydantic-core==")])
    assert any(p.startswith("pydantic-core==") and "(needed by pydantic)" in p and "neither in gpu_wheels.txt" in p
               for p in gpu_wheels.check())


def test_wheel_list_check_names_a_pin_below_pyproject_and_an_unneeded_wheel(tmp_path, monkeypatch):
    write_list(tmp_path, monkeypatch, lambda lines: [
        "grpcio==1.60.0" if line.startswith("grpcio==") else line for line in lines] + ["six==1.17.0"])
    problems = gpu_wheels.check()
    assert any(p.startswith("grpcio") and "(needed by pyproject.toml) is not met by grpcio==1.60.0" in p
               for p in problems)
    assert "six==1.17.0 in gpu_wheels.txt is needed by nothing vmesh runs" in problems
