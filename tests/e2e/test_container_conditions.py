"""The image's conditions, reproduced on the host: the model cache is built by root (as the
Dockerfile's `vmesh warm-cache` step does) and the services run as the unprivileged uid the
image uses, through a real request."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from services.client import VmeshClient
from services.mesh_process import ROOT, start_mesh

RUNTIME_UID = 65532  # the Dockerfile's USER


def as_runtime_user(home: Path) -> list[str]:
    """A command prefix that execs as RUNTIME_UID. Where the interpreter lives under a directory
    that user may not enter (a root-only home), a private mount namespace shows it just that
    directory, as an image would have it installed in a readable place."""
    interpreter = Path(os.path.realpath(sys.executable))
    switch = f'exec setpriv --reuid {RUNTIME_UID} --regid {RUNTIME_UID} --clear-groups env HOME={home} "$@"'
    hidden = next((p for p in interpreter.parents if p != Path("/") and not os.stat(p).st_mode & 0o001), None)
    if hidden is None:
        return ["sh", "-c", switch, "sh"]
    inner = interpreter.relative_to(hidden).parts[0]
    script = (f"set -e; hold=$(mktemp -d); mount --bind {hidden / inner} $hold; "
              f"mount -t tmpfs -o mode=0755 tmpfs {hidden}; mkdir -p {hidden / inner}; "
              f"mount --bind $hold {hidden / inner}; {switch}")
    return ["unshare", "-m", "sh", "-c", script, "sh"]


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the image's uid needs root")
def test_services_run_as_the_image_user_against_a_cache_built_by_root():
    cache = Path(tempfile.mkdtemp(prefix="vmesh-image-cache-"))
    home = Path(tempfile.mkdtemp(prefix="vmesh-home-"))
    try:
        cache.chmod(0o755)
        os.chown(home, RUNTIME_UID, RUNTIME_UID)
        # The Dockerfile's build steps, as root.
        subprocess.run([sys.executable, "-m", "services.cli", "warm-cache", "--cache-dir", str(cache)], cwd=ROOT,
                       check=True, capture_output=True, timeout=300)
        (cache / "kernels").mkdir(exist_ok=True)
        os.chown(cache / "kernels", RUNTIME_UID, RUNTIME_UID)
        model_dirs = [p for p in cache.iterdir() if p.is_dir() and p.name != "kernels"]
        assert model_dirs and all(p.stat().st_mode & 0o005 == 0o005 for p in model_dirs)

        mesh = start_mesh("--cache-dir", str(cache), prefix=as_runtime_user(home))
        try:
            for name, (_address, pid) in mesh.services.items():
                uid = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if line.startswith("Uid:"))
                assert uid == str(RUNTIME_UID), name

            async def ask():
                async with VmeshClient(mesh.address) as client:
                    return await client.complete(text="Say hi.", max_tokens=4, temperature=0, ignore_eos=True)

            _text, ids, _last = asyncio.run(ask())
            assert len(ids) == 4
        finally:
            assert mesh.stop() == 0
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
