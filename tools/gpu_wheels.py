"""What tools/gpu_check.sh needs on a GPU machine that cannot reach a package registry, staged in
the ignored folder .gpu-check/ of the checkout, and the check that keeps its list in step.

    python tools/gpu_wheels.py            download tools/gpu_wheels.txt's wheels for CPython 3.12 on
                                          x86_64 Linux into .gpu-check/wheels, and stage the embedded
                                          model (its GGUF, compressed and cut in two parts)
    python tools/gpu_wheels.py --check    verify the list against pyproject.toml and the requirements
                                          of the listed packages, without downloading (CI runs this)

The device machine takes at most 64 MiB of files per call, the working tree included: the wheels
and the second part of the model travel with the check's own call, the first part with a call just
before it (benchmarks/README.md, "GPU check", gives both commands).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = ROOT / "tools" / "gpu_wheels.txt"
STAGE = ROOT / ".gpu-check"
CALL_LIMIT_MIB = 64  # what one device call carries, the working tree included
MARGIN_MIB = 3  # for files the session's checkout holds beside this one's (results, notes)

# What the GPU machine's image already holds (the device notes' package list): None where its
# version was not recorded, which any pin accepts. Those below with versions were read there.
GPU_IMAGE: dict[str, str | None] = {
    "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "tokenizers": "0.23.2", "numpy": "2.5.2",
    "safetensors": "0.8.0", "huggingface-hub": "1.33.0",
    **dict.fromkeys([
        "jinja2", "markupsafe", "prometheus-client", "httpx", "httpcore", "anyio", "idna", "certifi", "h11", "click",
        "pyyaml", "tqdm", "requests", "packaging", "regex", "filelock", "fsspec", "sympy", "networkx", "setuptools",
        "annotated-doc", "typer", "charset-normalizer", "urllib3", "zipp", "ninja", "colorama", "importlib-metadata",
        "exceptiongroup", "sniffio"]),
}

# The GPU machine's Python, for the requirements' environment markers.
GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
PIP_PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                 "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
GGUF_ARCHIVE = "embedded.gguf.xz"
# Beside the parts: the converted model's small files, from which the check builds the embedded
# model's architecture with random weights when the first part did not come.
EMBEDDED_SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def pins() -> dict[str, str]:
    """tools/gpu_wheels.txt as canonical name -> version."""
    listed: dict[str, str] = {}
    for line in WHEEL_LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        key = canonicalize_name(name)
        if key in listed or not version:
            raise SystemExit(f"{WHEEL_LIST.name}: {line!r} must be NAME==VERSION, once per name")
        listed[key] = version
    return listed


def runtime_requirements() -> list[Requirement]:
    """pyproject.toml's dependencies and its gpu extra (the Triton kernels), for the GPU machine."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["gpu"]]
    return [r for r in map(Requirement, wanted) if r.marker is None or r.marker.evaluate(GPU_PYTHON)]


def needs_of(name: str) -> list[Requirement]:
    """The requirements of `name` as installed here (its names are what matters: they change
    rarely between versions); [] when it is not installed."""
    try:
        requires = importlib.metadata.distribution(name).requires or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [r for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate(GPU_PYTHON)]


def check() -> list[str]:
    """Every problem with the list: a dependency neither carried nor on the image, a pin outside
    a requirement's range, a listed wheel that nothing needs."""
    listed, problems, needed = pins(), [], set()
    todo = [(r, "pyproject.toml") for r in runtime_requirements()]
    while todo:
        requirement, wanted_by = todo.pop()
        key = canonicalize_name(requirement.name)
        version = listed.get(key, GPU_IMAGE.get(key))
        if key not in listed and key not in GPU_IMAGE:
            problems.append(f"{requirement} (needed by {wanted_by}) is neither in {WHEEL_LIST.name} nor on the GPU "
                            "machine's image")
            continue
        if version is not None and not requirement.specifier.contains(version, prereleases=True):
            where = WHEEL_LIST.name if key in listed else "the GPU machine's image"
            problems.append(f"{requirement} (needed by {wanted_by}) is not met by {key}=={version} in {where}")
        if key in listed and key not in needed:
            needed.add(key)
            if not needs_of(key):
                try:
                    importlib.metadata.distribution(key)
                except importlib.metadata.PackageNotFoundError:
                    problems.append(f"{key} is not installed here, so its own requirements cannot be checked")
            todo += [(r, key) for r in needs_of(key)]
    problems += [f"{key}=={listed[key]} in {WHEEL_LIST.name} is needed by nothing vmesh runs"
                 for key in sorted(set(listed) - needed)]
    return problems


def download(target: Path) -> list[Path]:
    """Exactly the listed wheels in `target`, for CPython 3.12 on x86_64 Linux."""
    target.mkdir(parents=True, exist_ok=True)
    listed = pins()
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               *(f"--platform={p}" for p in PIP_PLATFORMS), "--dest", str(target), "-r", str(WHEEL_LIST)]
    subprocess.run(command, check=True)
    kept = []
    for wheel in sorted(target.glob("*.whl")):
        name, version, _build, _tags = parse_wheel_filename(wheel.name)
        if listed.get(name) == str(version):
            kept.append(wheel)
        else:  # left by an earlier list: one version of each, or the install stops
            wheel.unlink()
    found = {parse_wheel_filename(w.name)[0] for w in kept}
    if found != set(listed):
        raise SystemExit(f"pip left no wheel for {sorted(set(listed) - found)}")
    return kept


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def tree_bytes() -> int:
    """What travels of the checkout besides carried folders: tracked and unignored files."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    return sum((ROOT / p).stat().st_size for p in listed if p and (ROOT / p).is_file())


def stage_model(stage: Path, second_call_bytes: int) -> dict:
    """The embedded GGUF, xz-compressed, in two parts: the second as large as the check's own call
    still carries beside `second_call_bytes`, the first for the call before it."""
    from vmesh.services.common.model_loading import EMBEDDED_MODEL_FILE, embedded_model_file, resolve_model_dir

    gguf = embedded_model_file()
    small = stage / "embedded"
    small.mkdir(parents=True, exist_ok=True)
    converted = resolve_model_dir(None)
    for name in EMBEDDED_SMALL_FILES:
        if (converted / name).is_file():
            shutil.copy(converted / name, small / name)
    archive = stage / GGUF_ARCHIVE
    print(f"compressing {gguf.name} ({gguf.stat().st_size / 2**20:.1f} MiB) once", file=sys.stderr)
    with gguf.open("rb") as src, lzma.open(archive, "wb", preset=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    budget = (CALL_LIMIT_MIB - MARGIN_MIB) * 2**20
    second = max(budget - second_call_bytes - sum(f.stat().st_size for f in small.iterdir()), 1 << 20)
    data = archive.read_bytes()
    archive.unlink()
    cut = max(len(data) - second, 0)
    parts = []
    for index, chunk in ((1, data[:cut]), (2, data[cut:])):
        folder = stage / f"model-{index}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        (folder / f"{GGUF_ARCHIVE}.part").write_bytes(chunk)
        parts.append({"folder": folder.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"file": EMBEDDED_MODEL_FILE, "sha256": sha256(gguf), "bytes": gguf.stat().st_size, "parts": parts}
    (small / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def folder_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="verify the list only (no download)")
    parser.add_argument("--no-model", action="store_true", help="download the wheels only")
    parser.add_argument("--dest", type=Path, default=STAGE, help="default: .gpu-check/ in the checkout")
    args = parser.parse_args(argv)
    problems = check()
    for problem in problems:
        print(f"gpu_wheels: {problem}", file=sys.stderr)
    if problems or args.check:
        if not problems:
            print(f"gpu_wheels: {len(pins())} wheels in {WHEEL_LIST.name} cover vmesh's runtime on the GPU machine")
        return 1 if problems else 0
    wheels = download(args.dest / "wheels")
    print(f"{len(wheels)} wheels, {folder_mib(args.dest / 'wheels'):.1f} MiB, in {args.dest / 'wheels'}")
    if not args.no_model:
        tree = tree_bytes()
        manifest = stage_model(args.dest, tree + int(folder_mib(args.dest / "wheels") * 2**20))
        print(f"embedded model in {len(manifest['parts'])} parts: "
              + ", ".join(f"{p['folder']} {p['bytes'] / 2**20:.1f} MiB" for p in manifest["parts"])
              + f"; the working tree {tree / 2**20:.1f} MiB travels with each call")
        first = folder_mib(args.dest / "model-1") + tree / 2**20
        second = sum(folder_mib(args.dest / f) for f in ("wheels", "embedded", "model-2")) + tree / 2**20
        print(f"on the GPU machine: a call carrying .gpu-check/model-1 ({first:.1f} MiB with the tree), then "
              f"tools/gpu_check.sh carrying .gpu-check/wheels, .gpu-check/embedded and .gpu-check/model-2 "
              f"({second:.1f} MiB); each under {CALL_LIMIT_MIB} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
