"""The benchmark's memory sampler reports each process's peak PSS, and nothing for a process
that is gone."""

from __future__ import annotations

import subprocess
import sys

from vmesh.services.bench.memory import PeakPss, pss_mib


def test_peak_pss_of_a_growing_process():
    """A fresh process that touches 80 MiB after a pause: its peak shows them (a fresh one, as a
    long-lived test process may reuse memory it already has)."""
    grow = ("import sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\n"
            "b = bytearray(80 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint('grown', flush=True)\n"
            "sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", grow], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before = pss_mib(child.pid)
        with PeakPss({"child": child.pid}, interval_s=0.01) as peaks:
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "grown"
        assert peaks.mib["child"] >= before + 70
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_has_no_figure():
    assert pss_mib(2**22 + 12345) is None
    with PeakPss({"ghost": 2**22 + 12345}, interval_s=0.01) as peaks:
        pass
    assert peaks.mib == {}
