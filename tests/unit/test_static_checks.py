"""The type checker and the linter pass over the code, as CI runs them."""

from __future__ import annotations

import subprocess
import sys

from vmesh.services.mesh_process import ROOT


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy_passes_over_services_and_kernels():
    from tools.typecheck import typecheck

    done = typecheck()  # as vmesh.services and vmesh.kernels, our own imports resolved (not Any)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues found in" in done.stdout and "vmesh.services" not in done.stderr


def test_ruff_is_clean():
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_product_imports_neither_benchmarks_nor_tests():
    """services/ and kernels/ are what installs; benchmarks/ and tests/ stay in the checkout."""
    import ast

    for folder in ("services", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                for name in names:
                    assert name.split(".")[0] not in ("benchmarks", "tests", "services", "kernels"), \
                        f"{path.relative_to(ROOT)} imports {name}"
