"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from tests.support.deployment import load_compose, render_all
from tests.support.prerequisites import missing
from vmesh.kernels.cpu_native import CpuKernelBuildError, load_cpu_kernels


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The C kernels of kernels/cpu, built into a fresh cache; skipped where no compiler exists
    (a failure under CI, whose image has one)."""
    try:
        return load_cpu_kernels(tmp_path_factory.mktemp("cache"))
    except CpuKernelBuildError as exc:
        missing(f"no C toolchain: {exc}", "CI runs the CPU kernels' tests, which need a C compiler")


@pytest.fixture(scope="module")
def compose() -> dict:
    """docker-compose.yml, parsed (the test_deploy_* modules)."""
    return load_compose()


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """The Kubernetes base and each overlay, rendered as kustomize would (the test_deploy_* modules)."""
    return render_all()
