"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from vmesh.kernels.cpu_native import CpuKernelBuildError, load_cpu_kernels


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The C kernels of kernels/cpu, built into a fresh cache; skipped where no compiler exists."""
    try:
        return load_cpu_kernels(tmp_path_factory.mktemp("cache"))
    except CpuKernelBuildError as exc:
        pytest.skip(f"no C toolchain: {exc}")
