"""The image's conditions, reproduced on the host: the model cache is built by root (as the
Dockerfile's `vmesh warm-cache` step does) and the services run as the unprivileged uid the
image uses, through a real request."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.checkout import ROOT
from tests.support.meshes import stops_cleanly
from vmesh.kernels.cpu_native import CpuKernelBuildError, built_kernels_path
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient
from vmesh.services.common.model_loading import default_cache_dir

RUNTIME_UID = 65532  # the Dockerfile's USER


def as_runtime_user(home: Path) -> list[str]:
    """A command prefix that execs as RUNTIME_UID. Where the interpreter, the virtual
    environment or the checkout lies under a directory that user may not enter (a root-only
    home, a 0700 temporary directory), a private mount namespace opens just that directory:
    a tmpfs over it holds each of its entries bound back in, with their own modes, as an image
    would have them installed in a readable place. The model cache gets no such help."""
    needed = [Path(os.path.realpath(sys.executable)), Path(sys.executable).parent, ROOT]
    hidden = sorted({p for path in needed for p in [path, *path.parents]
                     if p != Path("/") and p.is_dir() and not os.stat(p).st_mode & 0o001},
                    key=lambda p: len(p.parts))
    switch = f'exec setpriv --reuid {RUNTIME_UID} --regid {RUNTIME_UID} --clear-groups env HOME={home} "$@"'
    if not hidden:
        return ["sh", "-c", switch, "sh"]
    opened = "".join(
        f'hold=$(mktemp -d); mount --bind "{d}" "$hold"; mount -t tmpfs -o mode=0755 tmpfs "{d}"; '
        f'for e in "$hold"/* "$hold"/.[!.]* "$hold"/..?*; do [ -e "$e" ] || continue; n=$(basename "$e"); '
        f'if [ -d "$e" ]; then mkdir "{d}/$n"; else touch "{d}/$n"; fi; mount --bind "$e" "{d}/$n"; done; '
        for d in hidden)
    return ["unshare", "-m", "sh", "-c", f"set -e; {opened}{switch}", "sh"]


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the image's uid needs root")
def test_services_run_as_the_image_user_against_a_cache_built_by_root():
    cache = Path(tempfile.mkdtemp(prefix="vmesh-image-cache-"))
    home = Path(tempfile.mkdtemp(prefix="vmesh-home-"))
    try:
        cache.chmod(0o755)
        os.chown(home, RUNTIME_UID, RUNTIME_UID)
        # The Dockerfile's build steps, as root. Its kernel build is the checkout's own, which
        # run.sh has already built into the default cache: copied in as root with the mode a
        # root build gets (umask 022), warm-cache finds it rather than spend most of a minute
        # compiling the same object again. (The build itself is run.sh's `vmesh warm-cache`,
        # as root on CI, before the tests.)
        with contextlib.suppress(CpuKernelBuildError):  # no compiler: warm-cache says so and goes on
            if (built := built_kernels_path(default_cache_dir())).is_file():
                (cache / "kernels").mkdir()
                shutil.copy(built, cache / "kernels" / built.name)
                (cache / "kernels" / built.name).chmod(0o755)
        subprocess.run([sys.executable, "-m", "vmesh", "warm-cache", "--cache-dir", str(cache)], cwd=ROOT,
                       check=True, capture_output=True, timeout=300)
        (cache / "kernels").mkdir(exist_ok=True)
        os.chown(cache / "kernels", RUNTIME_UID, RUNTIME_UID)
        model_dirs = [p for p in cache.iterdir() if p.is_dir() and p.name != "kernels"]
        assert model_dirs and all(p.stat().st_mode & 0o005 == 0o005 for p in model_dirs)

        with stops_cleanly(start_mesh("--cache-dir", str(cache), prefix=as_runtime_user(home))) as mesh:
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
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
