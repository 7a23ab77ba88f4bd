"""Import rules no linter states: what installs imports nothing of the checkout's other folders,
nothing anywhere imports the top-level `services` folder by that name (from the checkout's root
it imports, but as modules apart from `vmesh.services`, so one class would exist twice), and no
folder at the checkout's root hides an installed distribution. ruff and mypy run in CI
(`.ci/run`, `make lint`)."""

from __future__ import annotations

import ast
import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

from tests.support.checkout import ROOT


def absolute_imports(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.module or ""


def test_the_product_imports_neither_benchmarks_nor_tests():
    """services/ and vmesh/kernels/ are what installs; benchmarks/ and tests/ stay in the checkout."""
    for folder in ("services", "vmesh/kernels"):
        assert (ROOT / folder / "__init__.py").is_file(), folder
        for path in (ROOT / folder).rglob("*.py"):
            for name in absolute_imports(path):
                assert name.split(".")[0] not in ("benchmarks", "tests", "services", "kernels"), \
                    f"{path.relative_to(ROOT)} imports {name}"


def test_nothing_imports_services_or_kernels_but_through_vmesh():
    for folder in ("tests", "benchmarks", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in absolute_imports(path):
                assert name.split(".")[0] not in ("services", "kernels"), f"{path.relative_to(ROOT)} imports {name}"


def test_no_package_at_the_checkout_s_root_shadows_an_installed_distribution():
    """Python started in the checkout's root (`python -m pytest`, `python -m vmesh` for each
    service) puts the root first on sys.path, so a package there hides an installed import name
    it shares: transformers 5.25 requires Hugging Face's `kernels` distribution, and a top-level
    kernels/ folder broke every model load (the kernels now lie in vmesh/kernels)."""
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")} | {p.stem for p in ROOT.glob("*.py")}
    assert {"vmesh", "services", "tests"} <= ours
    installed = importlib.metadata.packages_distributions()
    shadowed = {name: installed[name] for name in ours if set(installed.get(name, ["vmesh"])) != {"vmesh"}}
    assert not shadowed, f"folders at the checkout's root hide these installed distributions: {shadowed}"
