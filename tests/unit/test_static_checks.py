"""Import rules no linter states: what installs imports nothing of the checkout's other folders,
and nothing anywhere imports the top-level `services`/`kernels` folders by those names (from
the checkout's root they import, but as modules apart from `vmesh.services`/`vmesh.kernels`, so
one class would exist twice). ruff and mypy run in CI (`.ci/run`, `make lint`)."""

from __future__ import annotations

import ast
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
    """services/ and kernels/ are what installs; benchmarks/ and tests/ stay in the checkout."""
    for folder in ("services", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in absolute_imports(path):
                assert name.split(".")[0] not in ("benchmarks", "tests", "services", "kernels"), \
                    f"{path.relative_to(ROOT)} imports {name}"


def test_nothing_imports_services_or_kernels_but_through_vmesh():
    for folder in ("tests", "benchmarks", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in absolute_imports(path):
                assert name.split(".")[0] not in ("services", "kernels"), f"{path.relative_to(ROOT)} imports {name}"
