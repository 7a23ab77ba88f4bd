"""Fixtures shared by the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.deployment import load_compose, render_all
from tests.support.prerequisites import missing
from vmesh.kernels.cpu_native import CpuKernelBuildError, CpuKernels, load_cpu_kernels
from vmesh.services.common.structured import GrammarCompiler
from vmesh.services.worker.grammar_rows import GrammarTokenizer

EMBEDDED_VOCAB_SIZE = 49152  # the embedded model's logits width
EMBEDDED_EOS = 2


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory) -> Path:
    """A fresh cache holding the C kernels of vmesh/kernels/cpu, built once per run (a build is most of a
    minute here: every test that builds its own multiplies that); skipped where no compiler
    exists (a failure under CI, whose image has one)."""
    cache_dir = tmp_path_factory.mktemp("kernel-cache")
    try:
        load_cpu_kernels(cache_dir)
    except CpuKernelBuildError as exc:
        missing(f"no C toolchain: {exc}", "CI runs the CPU kernels' tests, which need a C compiler")
    return cache_dir


@pytest.fixture(scope="session")
def kernels(kernel_cache_dir: Path) -> CpuKernels:
    """The kernels of kernel_cache_dir, loaded (one object for the run: a test that patches it
    uses monkeypatch)."""
    return load_cpu_kernels(kernel_cache_dir)


@pytest.fixture(scope="module")
def compose() -> dict:
    """docker-compose.yml, parsed (the test_deploy_* modules)."""
    return load_compose()


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """The Kubernetes base and each overlay, rendered as kustomize would (the test_deploy_* modules)."""
    return render_all()


@pytest.fixture(scope="module")
def grammar_tokenizer(embedded_model_dir) -> GrammarTokenizer:
    """The embedded model's vocabulary as the worker's grammar matchers see it."""
    return GrammarTokenizer(embedded_model_dir / "tokenizer.json", EMBEDDED_VOCAB_SIZE, (EMBEDDED_EOS,))


@pytest.fixture(scope="module")
def compiler(grammar_tokenizer) -> GrammarCompiler:
    """A grammar compiler for the embedded model (modules with their own settings define theirs)."""
    return GrammarCompiler(grammar_tokenizer.tokenizer_json, EMBEDDED_VOCAB_SIZE, [EMBEDDED_EOS])
