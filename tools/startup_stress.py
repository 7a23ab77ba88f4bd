"""Start and stop `vmesh serve` many times; report every start that did not finish in time.

Not part of CI (it takes minutes): `python -m tools.startup_stress --runs 50`. A start that
hangs is killed after --timeout seconds; with py-spy installed, the launcher's Python stacks
are printed first, which is how a hang's cause is found.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time

from vmesh.services.bench.mesh import start_mesh


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one start may take")
    parser.add_argument("serve_flags", nargs="*", default=["--detokenizers", "2"],
                        help="flags for vmesh serve (after --)")
    args = parser.parse_args()
    hangs = 0
    durations = []
    for run in range(1, args.runs + 1):
        started = time.monotonic()
        try:
            mesh = start_mesh(*args.serve_flags, timeout=args.timeout, on_timeout=dump_stacks)
        except TimeoutError as exc:
            hangs += 1
            print(f"run {run}: HANG\n{exc}", flush=True)
            continue
        durations.append(time.monotonic() - started)
        code = mesh.stop()
        print(f"run {run}: started in {durations[-1]:.1f} s, stopped with code {code}", flush=True)
    if durations:
        print(f"{len(durations)} starts, median {sorted(durations)[len(durations) // 2]:.1f} s, "
              f"max {max(durations):.1f} s; {hangs} hangs", flush=True)
    return 1 if hangs else 0


def dump_stacks(pid: int) -> str:
    """Python stacks of the launcher and of every service it started: whichever never became
    ready shows where it waits (a child that never reached exec shows the launcher's command)."""
    if not shutil.which("py-spy"):
        return "(install py-spy for the stacks of the launcher and its services)"
    children = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    report = [f"\nservices of launcher {pid}:\n{children}"]
    for line in [f"{pid} launcher", *children.splitlines()]:
        target = line.split()[0]
        dump = subprocess.run(["py-spy", "dump", "--pid", target], capture_output=True, text=True, timeout=60)
        report.append(f"--- {line}\n{dump.stdout}{dump.stderr}")
    return "\n".join(report)


if __name__ == "__main__":
    sys.exit(main())
