"""The GPU path run for real, in one command that fits a few minutes on one GPU: tools/gpu_check.sh
installs the wheels tools/gpu_wheels.py staged and runs this driver, which writes one JSON (and its
progress to the log) into the output folder. Sections, in order, each recorded as it ends:

  environment      torch, CUDA device, Triton, the model's form
  kernels          every Triton kernel against its torch reference, float32 and bfloat16, the CPU
                   tests' shapes and large ones (tools/gpu_check_kernels.py)
  engine_tiny      the worker on the tiny test models, greedy tokens against transformers
  engine_embedded  the in-process engine on the embedded model, against transformers
  serve            `vmesh serve --device DEVICE`: gRPC and HTTP, a kill -9 of the worker, recovery
  throughput       `vmesh bench offline` (the standard workload: transformers `generate`, the engine,
                   the mesh in float32 and bfloat16) and transformers' single-request latency
  claims           `vmesh bench claims`: the worker's duty cycle with and without async scheduling,
                   stateful and stateless, on the embedded model then the tiny one

--dry-run runs on a CPU what a CPU can: the kernels through the Triton interpreter on small shapes,
the model sections on the smallest sizes, and the bench commands checked against `vmesh bench`'s
own parser (CI runs it: tests/e2e/test_gpu_check_dry_run.py). A section that would not finish in
the time left is skipped and says so; the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import lzma
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("environment", "kernels", "engine_tiny", "engine_embedded", "serve", "throughput", "claims")
# Seconds a section needs on the GPU to be worth starting (it is skipped with less left).
NEEDS_S = {"kernels": 60, "engine_tiny": 30, "engine_embedded": 40, "serve": 80, "throughput": 100, "claims": 100}
THROUGHPUT_BASELINES = "transformers,engine,mesh,mesh-bf16"


class Check:
    """The run's state: where results go, the device, the clock, and the model the sections use."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.dry_run: bool = args.dry_run
        self.device = "cpu" if args.dry_run else "cuda"
        self.deadline = time.monotonic() + args.budget_s
        self.out: Path = args.out
        self.work = work
        self.stage: Path = args.stage
        self.result: dict[str, Any] = {"dry_run": self.dry_run, "device": self.device, "budget_s": args.budget_s,
                                       "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "sections": {}}
        self.embedded: Path | None = None  # the embedded model's converted directory, once prepared
        self.embedded_form = ""
        self._bench_tiny: Path | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=1, default=str))

    def run(self, name: str, section: Callable[[Check], dict[str, Any]]) -> None:
        needs = 0 if self.dry_run else NEEDS_S.get(name, 0)
        if self.left() < needs:
            self.result["sections"][name] = {"status": "skipped", "reason": f"{self.left():.0f} s left, needs {needs}"}
        else:
            print(f"[gpu_check] {name} ({self.left():.0f} s left)", flush=True)
            started, cpu_started = time.monotonic(), cpu_seconds()
            try:
                body = section(self)
                status = body.pop("status", "passed" if body.get("passed", True) else "failed")
            except Exception as exc:
                body, status = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}, "failed"
                print(body["traceback"], flush=True)
            self.result["sections"][name] = {"status": status, "seconds": round(time.monotonic() - started, 1),
                                             "cpu_seconds": round(cpu_seconds() - cpu_started, 1), **body}
        print(f"[gpu_check] {name}: {self.result['sections'][name]['status']}", flush=True)
        self.save()

    def embedded_model(self) -> Path:
        if self.embedded is None:
            self.embedded, self.embedded_form = prepare_embedded(self)
        return self.embedded

    def bench_tiny(self) -> Path:
        """The bench's tiny model (`vmesh bench claims`'s: the embedded tokenizer, a 2-layer body)."""
        from vmesh.services.bench.claims import tiny_model_dir

        if self._bench_tiny is None:
            self._bench_tiny = tiny_model_dir(self.work / "bench-tiny")
        return self._bench_tiny

    def bench(self, argv: list[str], name: str) -> dict[str, Any]:
        """`vmesh bench ARGV` in its own process, its JSON back; in the dry run only parsed by the
        bench's own command line, so that a flag it no longer has fails here."""
        out = self.work / "bench" / name
        command = [sys.executable, "-m", "vmesh", "bench", *argv, "--out", str(out)]
        if self.dry_run:
            from vmesh.services.bench.cli import build_parser

            build_parser().parse_args(command[4:])
            return {"status": "planned", "command": command[3:]}
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=max(self.left() - 5, 10))
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", flush=True)
        if done.returncode != 0:
            raise RuntimeError(f"vmesh bench {argv[0]} exited with {done.returncode}: {done.stderr[-2000:]}")
        return json.loads((out / f"{argv[0]}.json").read_text())


def cpu_seconds() -> float:
    """This process's CPU time and that of its finished children (the bench runs, a mesh's services)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def prepare_embedded(check: Check) -> tuple[Path, str]:
    """The embedded model: this machine's own in the dry run; on the GPU machine its GGUF rebuilt
    from the staged parts (tools/gpu_wheels.py) as the package the loader looks for, or, where the
    first part did not come, its architecture and tokenizer with random weights."""
    from vmesh.services.common.model_loading import EMBEDDED_MODEL_PACKAGE, resolve_model_dir

    if check.dry_run:
        return resolve_model_dir(None), "the embedded model (this machine's package)"
    from tools.gpu_wheels import EMBEDDED_SMALL_FILES, GGUF_ARCHIVE, sha256

    small = check.stage / "embedded"
    manifest = json.loads((small / "manifest.json").read_text())
    parts = [check.stage / p["folder"] / f"{GGUF_ARCHIVE}.part" for p in manifest["parts"]]
    if all(p.is_file() for p in parts):
        package = check.work / "site" / EMBEDDED_MODEL_PACKAGE
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").touch()  # a regular package: found before any namespace portion
        gguf = package / manifest["file"]
        with gguf.open("wb") as dst:
            decompressor = lzma.LZMADecompressor()
            for part in parts:
                dst.write(decompressor.decompress(part.read_bytes()))
        if sha256(gguf) != manifest["sha256"]:
            raise RuntimeError(f"{gguf.name} rebuilt from its parts does not match its sha256")
        sys.path.insert(0, str(package.parent))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(package.parent), os.environ.get("PYTHONPATH")) if p)
        importlib.invalidate_caches()
        return resolve_model_dir(None), "the embedded model's GGUF (rebuilt from its parts)"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target = check.work / "embedded-random"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(small)).save_pretrained(target)
    for name in EMBEDDED_SMALL_FILES[1:]:
        shutil.copy(small / name, target / name)
    missing = [p.parent.name for p in parts if not p.is_file()]
    return target, f"the embedded model's architecture and tokenizer, random weights ({', '.join(missing)} missing)"


def environment(check: Check) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available()}
    for name in ("triton", "transformers", "tokenizers", "grpcio", "protobuf", "xgrammar", "llguidance"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "missing"
    if check.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: run tools/gpu_check.sh --dry-run on a CPU machine")
        info.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    info["embedded_model"] = str(check.embedded_model())
    info["embedded_form"] = check.embedded_form
    return info


def kernels(check: Check) -> dict[str, Any]:
    from tools.gpu_check_kernels import check_kernels

    return check_kernels(check.device, check.dry_run)


def engine_tiny(check: Check) -> dict[str, Any]:
    from tools.gpu_check_engine import engine_tiny as run

    return run(check.device, check.dry_run, check.work)


def engine_embedded(check: Check) -> dict[str, Any]:
    from tools.gpu_check_engine import engine_embedded as run

    return {"model": check.embedded_form, **run(check.device, check.dry_run, check.embedded_model())}


def serve(check: Check) -> dict[str, Any]:
    from tools.gpu_check_engine import serve as run

    # The dry run serves the bench's tiny model: a mesh of the embedded model costs a CPU far more
    # than what the run checks.
    model = check.bench_tiny() if check.dry_run else check.embedded_model()
    return run(check.device, check.dry_run, model)


def model_flags(check: Check) -> list[str]:
    """--model for the bench commands: none for the embedded model's own package."""
    model = check.embedded_model()
    return [] if "GGUF" in check.embedded_form or check.dry_run else ["--model", str(model)]


def throughput(check: Check) -> dict[str, Any]:
    """The standard workload through `vmesh bench offline`, then transformers alone on its latency
    prompt: one token (its time to first token) and the workload's length."""
    from vmesh.services.bench.common import load_workload
    from vmesh.services.bench.offline import transformers_generate

    offline = check.bench(["offline", "--baselines", THROUGHPUT_BASELINES, "--repeats", "2", "--kv-cache-memory",
                           "4GiB", *model_flags(check)], "offline")
    work = load_workload("standard", None, 2 if check.dry_run else None)
    model = check.bench_tiny() if check.dry_run else check.embedded_model()
    first = transformers_generate(model, [work["latency_prompt"]], 1)
    whole = transformers_generate(model, [work["latency_prompt"]], work["max_tokens"])
    first(), whole()  # warm-up
    ttft_s, whole_s = 1 / first(), work["max_tokens"] / whole()
    per_token_s = (whole_s - ttft_s) / max(work["max_tokens"] - 1, 1)
    latency = {"ttft_ms": ttft_s * 1e3, "ms_per_output_token": per_token_s * 1e3, "e2e_ms": whole_s * 1e3,
               "max_tokens": work["max_tokens"]}
    body: dict[str, Any] = {"transformers_single_request": latency, "offline": offline}
    if offline.get("status") == "planned":
        body["status"] = "planned"
        return body
    tps = offline["tokens_per_s"]
    body.update(tokens_per_s=tps, mesh_over_transformers=tps["mesh"] / tps["transformers"],
                engine_over_transformers=tps["engine"] / tps["transformers"], mesh_latency=offline["latency"],
                mesh_duty_cycle=offline["mesh_duty_cycle"])
    return body


def claims(check: Check) -> dict[str, Any]:
    """`vmesh bench claims` per model, the embedded one first (the headline), each while time is left."""
    body: dict[str, Any] = {"models": {}}
    random_weights = "GGUF" not in check.embedded_form and not check.dry_run
    # The tiny model takes its tokenizer from the embedded model's package, absent with random weights.
    for model in ("embedded",) if random_weights else ("embedded", "tiny"):
        if not check.dry_run and check.left() < NEEDS_S["claims"]:
            body["models"][model] = {"status": "skipped", "reason": f"{check.left():.0f} s left"}
            continue
        try:
            result = check.bench(["claims", "--models", model, *model_flags(check)], f"claims-{model}")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the other model may still fit
            body["models"][model] = {"status": "failed", "error": str(exc)[-2000:]}
            continue
        if result.get("status") == "planned":
            body["models"][model] = result
            continue
        figures = result["models"][model]
        modes = figures["modes"]
        body["models"][model] = {
            "duty_cycle": {name: m["duty_cycle"] for name, m in modes.items()},
            "tokens_per_s": {name: m["tokens_per_s"] for name, m in modes.items()},
            "bytes_per_decode_step": {name: m["bytes_per_decode_step"] for name, m in modes.items()},
            "duty_cycle_async_over_sync": figures["duty_cycle_async_over_sync"],
            "bytes_stateless_over_stateful": figures["bytes_stateless_over_stateful"]}
    statuses = {m.get("status") for m in body["models"].values()}
    if statuses == {"planned"}:
        body["status"] = "planned"
    elif "failed" in statuses:
        body["status"] = "failed"
    return body


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the GPU check exists for, from the sections that ran."""
    s = result["sections"]

    def get(name: str, *keys: str) -> Any:
        value: Any = s.get(name, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return {"statuses": {name: s.get(name, {}).get("status", "not run") for name in SECTIONS},
            "kernels_worst_error": get("kernels", "worst_error"),
            "greedy_equal": {"tiny_float32": get("engine_tiny", "float32_equal"),
                             "tiny_bfloat16": get("engine_tiny", "bfloat16_equal"),
                             "embedded": get("engine_embedded", "equal"), "serve_grpc": get("serve", "grpc_equal")},
            "tokens_per_s": get("throughput", "tokens_per_s"),
            "mesh_over_transformers": get("throughput", "mesh_over_transformers"),
            "duty_cycle": {m: get("claims", "models", m, "duty_cycle") for m in ("embedded", "tiny")}}


SECTION_FUNCTIONS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "environment": environment, "kernels": kernels, "engine_tiny": engine_tiny, "engine_embedded": engine_embedded,
    "serve": serve, "throughput": throughput, "claims": claims}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on a CPU: everything but what needs CUDA")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"))
    parser.add_argument("--budget-s", type=float, default=450.0, help="sections that would end past it are skipped")
    parser.add_argument("--stage", type=Path, default=ROOT / ".gpu-check", help="tools/gpu_wheels.py's folder")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="a subset, comma-separated")
    args = parser.parse_args(argv)
    if args.dry_run:  # before any kernel module is imported: Triton reads it at definition
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    threads = torch.get_num_threads()
    import tests.conftest  # noqa: F401  (its thread cap is the CPU tests'; the GPU machine keeps its cores)

    if not args.dry_run:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="vmesh-gpu-check-") as tmp:
        check = Check(args, Path(tmp))
        for name in args.sections.split(","):
            check.run(name, SECTION_FUNCTIONS[name])
        check.result["summary"] = summary(check.result)
        check.save()
    print(json.dumps(check.result["summary"], indent=1), flush=True)
    return 1 if any(s["status"] == "failed" for s in check.result["sections"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
