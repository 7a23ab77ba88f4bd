"""The benchmark's memory sampler reports each process's peak PSS, and nothing for a process
that is gone."""

from __future__ import annotations

import os

from benchmarks.memory import PeakPss, pss_mib


def test_peak_pss_of_a_growing_process():
    with PeakPss({"me": os.getpid()}, interval_s=0.01) as peaks:
        before = pss_mib(os.getpid())
        ballast = bytearray(64 << 20)  # touched: 64 MiB more resident
        ballast[::4096] = b"x" * len(ballast[::4096])
    assert peaks.mib["me"] >= before + 60
    del ballast


def test_a_process_that_is_gone_has_no_figure():
    assert pss_mib(2**22 + 12345) is None
    with PeakPss({"ghost": 2**22 + 12345}, interval_s=0.01) as peaks:
        pass
    assert peaks.mib == {}
