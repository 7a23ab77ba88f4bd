"""mypy over the package as it installs: `vmesh.services` and `vmesh.kernels`.

    python -m tools.typecheck

A checkout keeps services/ and kernels/ at its top, where mypy cannot see them as
`vmesh.services`/`vmesh.kernels` (the names every module imports them by), so this stages a
`vmesh/` package of symlinks to them in a temporary folder and checks that. Settings:
pyproject.toml's [tool.mypy]."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def typecheck() -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="vmesh-typecheck-") as tmp:
        package = Path(tmp) / "vmesh"
        package.mkdir()
        (package / "__init__.py").touch()
        for name, source in (("v1", ROOT / "vmesh" / "v1"), ("services", ROOT / "services"),
                             ("kernels", ROOT / "kernels")):
            (package / name).symlink_to(source, target_is_directory=True)
        return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                               "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "vmesh.services", "-p", "vmesh.kernels"],
                              cwd=tmp, capture_output=True, text=True, timeout=600)


def main() -> int:
    done = typecheck()
    print(done.stdout + done.stderr, end="")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
