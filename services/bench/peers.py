"""Peer engines in `vmesh bench offline --baselines`: vLLM's CPU build and llama.cpp, each in
the virtual environment that `benchmarks/peers/setup.sh` builds (they pin torch and
transformers versions vmesh does not share), driven through `peer_runner.py` over a pipe so
that their rounds interleave with vmesh's in one sitting, on the same token ids and the
same weights: vLLM reads the checkpoint vmesh converted from the GGUF, llama.cpp the GGUF."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

# baseline name -> (environment under the peers directory, engine, dtype, KV cache dtype)
PEER_BASELINES = {
    "vllm": ("vllm", "vllm", "float32", "auto"),
    "vllm-bf16": ("vllm", "vllm", "bfloat16", "auto"),
    # vLLM's own 8-bit KV cache (--kv-cache-dtype fp8), beside vmesh's --kv-cache-dtype int8.
    "vllm-bf16-fp8kv": ("vllm", "vllm", "bfloat16", "fp8"),
    "llama.cpp": ("llama.cpp", "llama.cpp", "gguf", "auto"),
}
PEERS_DIR_ENV = "VMESH_PEERS_DIR"
RUNNER = Path(__file__).resolve().parent / "peer_runner.py"
READY_TIMEOUT_S = 900.0  # vLLM compiles its model with inductor on first start
ROUND_TIMEOUT_S = 3600.0  # llama.cpp serves one sequence at a time
# vLLM's CPU guide preloads these; the Debian package libtcmalloc-minimal4 provides the first.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


class PeerError(RuntimeError):
    pass


def default_peers_dir() -> Path:
    return Path(os.environ.get(PEERS_DIR_ENV) or Path.home() / ".cache" / "vmesh-peers")


def peer_python(peers_dir: Path, baseline: str) -> Path:
    environment = PEER_BASELINES[baseline][0]
    python = peers_dir / environment / "bin" / "python"
    if not python.is_file():
        raise PeerError(f"baseline {baseline!r} needs the peer environment {peers_dir / environment}: "
                        f"build it once with `bash benchmarks/peers/setup.sh {peers_dir}` "
                        f"(or point --peers-dir / {PEERS_DIR_ENV} at one)")
    return python


def peer_environment(baseline: str, python: Path, threads: int, kv_cache_bytes: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # nothing of vmesh's checkout in the peer's imports
    if PEER_BASELINES[baseline][1] == "vllm":
        # All cores for the model, none held back for vLLM's own processes, and the same KV
        # budget as vmesh's (whole GiB: vLLM's unit), with the libraries its CPU guide preloads.
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE=str(max(1, round(kv_cache_bytes / (1 << 30)))))
        preload = [str(p) for p in (TCMALLOC, python.parent.parent / "lib" / "libiomp5.so") if p.is_file()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    return env


class PeerProcess:
    """One peer engine, loaded once; `run()` times one round of the workload (tokens/s)."""

    def __init__(self, baseline: str, peers_dir: Path, *, model_dir: Path, gguf: Path, workload: Path,
                 requests: int, max_tokens: int, max_model_len: int, threads: int, kv_cache_bytes: int):
        python = peer_python(peers_dir, baseline)
        _, engine, dtype, kv_cache_dtype = PEER_BASELINES[baseline]
        config = {"engine": engine, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "model_dir": str(model_dir),
                  "gguf": str(gguf),
                  "workload": str(workload), "requests": requests, "max_tokens": max_tokens,
                  "max_model_len": max_model_len, "threads": threads}
        self.baseline = baseline
        # Kept open while the peer runs (its stderr), closed by close(); kept on disk for reading.
        self.log: IO[str] = tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w+", prefix=f"vmesh-bench-{baseline}-", suffix=".log", delete=False)
        # A session of its own: vLLM runs its model in child processes, which close() ends too.
        self.process = subprocess.Popen([str(python), str(RUNNER), json.dumps(config)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True,
                                        env=peer_environment(baseline, python, threads, kv_cache_bytes))
        try:
            self._read(timeout_s=READY_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        # The runner prints nothing but one JSON line per command, so nothing waits in the
        # pipe's buffer beyond the line asked for.
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.log.flush()
            tail = "".join(Path(self.log.name).read_text(errors="replace").splitlines(keepends=True)[-15:])
            self.close()
            raise PeerError(f"{self.baseline} did not answer within {timeout_s:.0f} s or stopped "
                            f"(log {self.log.name}):\n{tail}")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError as exc:
            self.close()
            raise PeerError(f"{self.baseline} answered {line[:200]!r}, not JSON (log {self.log.name})") from exc
        if "error" in reply:
            raise PeerError(f"{self.baseline}: {reply['error']}")
        return reply

    def _ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._read(timeout_s=ROUND_TIMEOUT_S)

    def run(self) -> float:
        return float(self._ask("generate")["tokens_per_s"])

    def latency(self) -> dict[str, float]:
        return self._ask("latency")

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):  # what is left of its session
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        if not self.log.closed:
            self.log.close()
