"""Fixtures shared by the unit tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.deployment import load_compose, render_all
from tests.support.prerequisites import missing
from vmesh.kernels.cpu_native import CpuKernelBuildError, CpuKernels, built_kernels_path, load_cpu_kernels
from vmesh.services.common.model_loading import default_cache_dir
from vmesh.services.common.structured import GrammarCompiler
from vmesh.services.worker.grammar_rows import GrammarTokenizer

EMBEDDED_VOCAB_SIZE = 49152  # the embedded model's logits width
EMBEDDED_EOS = 2


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory) -> Path:
    """A fresh cache holding the C kernels of vmesh/kernels/cpu, once per run; skipped where no
    compiler exists (a failure under CI, whose image has one). A build is most of a minute here,
    so the one `vmesh warm-cache` left in the default cache (./run.sh's setup builds it) is copied
    when its key, the sources, compiler and CPU, is this checkout's; otherwise the run builds."""
    cache_dir = tmp_path_factory.mktemp("kernel-cache")
    try:
        warm = built_kernels_path(default_cache_dir())
        if warm.is_file():
            fresh = built_kernels_path(cache_dir)
            fresh.parent.mkdir(parents=True)
            shutil.copy2(warm, fresh)
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
