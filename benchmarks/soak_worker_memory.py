"""What the worker's memory growth under the soak is made of: `--bursts` bursts of
benchmarks.soak_memory's load; after each, the worker's PSS split by mapping (the main heap,
anonymous memory: other malloc arenas and torch's buffers, files); then glibc's `malloc_trim(0)`
is called in the worker through gdb, and its PSS read again (what comes back was free memory the
allocator kept, not memory in use). Needs gdb and permission to attach (root).

    nice -n 10 .venv/bin/python -m benchmarks.soak_worker_memory [--bursts 6] [--streams 128] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from pathlib import Path

from benchmarks.soak_memory import _burst
from vmesh.services.bench.memory import pss_mib
from vmesh.services.bench.mesh import start_mesh


def pss_by_mapping(pid: int) -> dict[str, float]:
    """PSS in MiB per kind of mapping: heap, anon, file, stack (and the kernel's, near 0)."""
    kinds: dict[str, float] = {}
    kind = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and not parts[0].endswith(":"):  # a mapping's header line: its address range first
            path = parts[5] if len(parts) > 5 else ""
            kind = ("heap" if path == "[heap]" else "anon" if not path else "stack" if path.startswith("[stack")
                    else "file" if path.startswith("/") else path)
        elif line.startswith("Pss:"):
            kinds[kind] = kinds.get(kind, 0.0) + int(parts[1]) / 1024
    return {k: round(v, 1) for k, v in kinds.items() if k in ("heap", "anon", "file", "stack")}


def report(label: str, pid: int) -> None:
    print(f"{label}: worker PSS {pss_mib(pid):.1f} MiB {pss_by_mapping(pid)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    mesh = start_mesh()
    try:
        worker = next(pid for name, (_, pid) in mesh.services.items() if name.startswith("worker"))
        report("start", worker)
        for number in range(1, args.bursts + 1):
            started = time.monotonic()
            asyncio.run(_burst(mesh, args.streams, args.max_tokens))
            report(f"burst {number} ({time.monotonic() - started:.0f} s)", worker)
        subprocess.run(["gdb", "-p", str(worker), "-batch", "-ex", "call (int) malloc_trim(0)"], check=True,
                       capture_output=True, timeout=300)
        report("after malloc_trim(0)", worker)
        asyncio.run(_burst(mesh, args.streams, args.max_tokens))
        report("one more burst", worker)
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
