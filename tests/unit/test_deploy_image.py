"""The image (the Dockerfile), checked statically: what it copies and installs, and the paths its
user must be able to write, under Kubernetes' read-only root filesystem and compose's volumes."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.checkout import ROOT
from tests.support.deployment import all_containers, dockerfile_chowned, dockerfile_env, pod_templates, vmesh_role


def test_k8s_every_path_the_image_writes_is_a_writable_volume(rendered):
    """With a read-only root filesystem, each directory a service writes to (from the image's
    ENV: HOME, TRITON_CACHE_DIR, VMESH_CACHE_DIR/kernels for the worker's CPU kernels; /tmp for
    everyone) must be an emptyDir mounted read-write; and the image makes those directories its
    user's, for compose, where the root filesystem stays the image's."""
    env = dockerfile_env()
    writes = {"worker": ["/tmp", env["HOME"], env["TRITON_CACHE_DIR"], env["VMESH_CACHE_DIR"] + "/kernels"]}
    for role in ("frontend", "detokenizer", "scheduler"):
        writes[role] = ["/tmp", env["HOME"]]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert set(writes["worker"]) - {"/tmp"} <= dockerfile_chowned()
    assert "USER 65532:65532" in dockerfile
    for name, docs in rendered.items():
        for doc, pod in pod_templates(docs):
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for container in all_containers(pod):
                role = vmesh_role(container)
                for path in writes.get(role, ["/tmp"]):
                    mounts = [m for m in container.get("volumeMounts", [])
                              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
                    assert mounts, f"{name}/{doc['metadata']['name']}: nothing writable at {path}"
                    mount = max(mounts, key=lambda m: len(m["mountPath"]))  # the one that shadows the rest
                    assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly"), f"{name}: {path}"


def test_compose_shares_a_model_cache_volume_writable_by_the_image_user(compose):
    """The converted-model cache is the named volume `models` at the image's VMESH_CACHE_DIR for
    every service that loads the model; a new volume copies the image's directory and owners, so
    the cache and its kernels directory must be the runtime user's in the image."""
    cache = dockerfile_env()["VMESH_CACHE_DIR"]
    assert "models" in compose["volumes"]
    for name in ("worker", "frontend", "detokenizer"):
        assert f"models:{cache}" in compose["services"][name]["volumes"], name
    assert {cache, f"{cache}/kernels"} <= dockerfile_chowned()
    for service in compose["services"].values():
        assert not service.get("image", "x:pinned").endswith(":latest") and ":" in service.get("image", "x:pinned")


def test_image_copies_what_the_package_is_built_from():
    """`pip install` in the image needs the package's folder, the folders its symlinks point to,
    and nothing else of the checkout (benchmarks and tests stay out of the image). It installs
    from a folder apart from the working directory, so `python -m vmesh` (how the launcher starts
    each service) finds the installed package, not the sources."""
    import tomllib

    setuptools_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    linked = {os.readlink(p).removeprefix("../") for p in (ROOT / "vmesh").iterdir() if p.is_symlink()}
    assert linked == {"services"}
    needed = {*linked, "vmesh", "pyproject.toml", "README.md"}
    copied, destinations = set(), set()
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        if line.startswith("COPY "):
            copied.update(line.split()[1:-1])
            destinations.add(line.split()[-1])
    assert needed == copied
    assert {p.split(".")[0] for p in setuptools_config["packages"]["find"]["include"]} == {"vmesh"}
    source = Path(os.path.commonpath(destinations))
    workdirs = [Path(line.split()[1]) for line in lines if line.startswith("WORKDIR ")]
    assert workdirs and not any(w.is_relative_to(source) for w in workdirs)  # `-m vmesh` finds the install
    assert f'pip install "{source}${{VMESH_EXTRAS}}"' in "\n".join(lines)
