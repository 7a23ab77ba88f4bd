"""The benchmark's memory figure: each process's peak PSS over the block, without sampling,
including memory freed before the block ends and excluding what was freed before it began;
nothing for a process that is gone."""

from __future__ import annotations

import subprocess
import sys

from vmesh.services.bench.memory import PeakPss, pss_mib

# A fresh process (a long-lived test process may reuse memory it already has) that on each line
# of input either maps and touches 80 MiB ("grow") or frees them ("free"), and says so.
STEPS = ("import sys\nb = None\nprint('ready', flush=True)\nfor line in sys.stdin:\n"
         "    if line.strip() == 'grow':\n        b = bytearray(80 << 20)\n"
         "        b[::4096] = b'x' * len(b[::4096])\n    else:\n        b = None\n"
         "    print('done', flush=True)\n")


def _child() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", STEPS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def _tell(child: subprocess.Popen, what: str) -> None:
    child.stdin.write(what + "\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "done"


def test_peak_pss_of_a_process_that_grows():
    child = _child()
    try:
        before = pss_mib(child.pid)
        with PeakPss({"child": child.pid}) as peaks:
            _tell(child, "grow")
        assert peaks.mib["child"] >= before + 70
    finally:
        child.kill()
        child.wait()


def test_memory_freed_before_the_end_still_counts_and_before_the_start_does_not():
    child = _child()
    try:
        _tell(child, "grow")
        _tell(child, "free")  # a peak before the block: not the block's
        before = pss_mib(child.pid)
        with PeakPss({"child": child.pid}) as quiet:
            pass
        assert quiet.mib["child"] < before + 40
        with PeakPss({"child": child.pid}) as peaks:
            _tell(child, "grow")
            _tell(child, "free")
        assert pss_mib(child.pid) < before + 40  # gone by the end ...
        assert peaks.mib["child"] >= before + 70  # ... yet the peak holds it
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_has_no_figure():
    assert pss_mib(2**22 + 12345) is None
    with PeakPss({"ghost": 2**22 + 12345}) as peaks:
        pass
    assert peaks.mib == {}
