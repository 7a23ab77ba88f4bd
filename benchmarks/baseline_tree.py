"""A benchmark's before/after trees: this checkout, and a temporary git worktree of a baseline
revision, so one script run can time both in alternating rounds."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def baseline_trees(baseline_ref: str | None) -> Iterator[dict[str, Path]]:
    """{name: tree}: "this" checkout, and `baseline_ref`'s worktree (removed after) when given."""
    if baseline_ref is None:
        yield {"this": CHECKOUT}
        return
    base = Path(tempfile.mkdtemp(prefix="vmesh-baseline-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), baseline_ref], cwd=CHECKOUT, check=True,
                   capture_output=True)
    try:
        yield {baseline_ref: base, "this": CHECKOUT}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=CHECKOUT, check=False)
