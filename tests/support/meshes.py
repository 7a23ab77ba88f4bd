"""Meshes that tests start themselves (beside the shared fixtures)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vmesh.services.bench.mesh import RunningMesh


@contextlib.contextmanager
def stops_cleanly(mesh: RunningMesh) -> Iterator[RunningMesh]:
    """`mesh` for the block; then it is stopped, and its launcher must exit 0. When the block
    fails, the stop is only cleanup: the block's failure is the one reported, never the stop's."""
    try:
        yield mesh
    except BaseException:
        mesh.stop()
        raise
    code = mesh.stop()
    assert code == 0, f"the mesh's launcher exited with {code}; its output:\n" + "".join(mesh.output[-30:])
