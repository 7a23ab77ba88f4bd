"""The deployment files (docker-compose.yml, k8s/, the Dockerfile) as the tests read them: the
services they run, each container command through the real `vmesh` CLI parser, and the
Kubernetes sets rendered as kustomize would render them."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.checkout import ROOT
from vmesh.services.cli import build_parser
from vmesh.services.common.config_flags import env_name

# The mesh's services as the deployment files name them, in compose's depends_on order (each
# starts once those before it are healthy).
VMESH_SERVICES = ("worker", "detokenizer", "scheduler", "frontend")


def load_compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def parse_cli(argv: list[str]):
    """The real parser; argparse exits on an unknown flag, which fails the test."""
    return build_parser().parse_args(argv)


def env_flags() -> set[str]:
    """Every VMESH_<FLAG> variable some subcommand reads."""
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices.values()
    return {env_name(option) for sub in [parser, *subcommands] for action in sub._actions
            for option in action.option_strings}


def k8s_documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted((ROOT / "k8s/base").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


# --- Rendered manifests -------------------------------------------------------------------------
# No kustomize binary here: render() reads a kustomization the way kustomize does for the features
# these files use (resources, patches with a target, images) and applies patches with a strategic
# merge reduced to the cases used: maps merge, null deletes a key, lists of named items (containers,
# volumes, env, mounts) merge by name, any other list is replaced.

K8S_SETS = {"base": "k8s/base", "cpu": "k8s/overlays/cpu", "tracing": "k8s/overlays/tracing",
            "keda": "k8s/overlays/keda", "tensor-parallel": "k8s/overlays/tensor-parallel"}

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


def strategic_merge(target, patch):
    if isinstance(target, dict) and isinstance(patch, dict):
        merged = dict(target)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value)
            else:
                merged[key] = value
        return merged
    if (isinstance(target, list) and isinstance(patch, list) and patch
            and all(isinstance(i, dict) and "name" in i for i in target + patch)):
        merged = list(target)
        for item in patch:
            at = next((n for n, old in enumerate(merged) if old["name"] == item["name"]), None)
            if at is None:
                merged.append(item)
            else:
                merged[at] = strategic_merge(merged[at], item)
        return merged
    return patch


def split_image(image: str) -> tuple[str, str | None]:
    name, _, _digest = image.partition("@")
    head, sep, tag = name.rpartition(":")
    return (head, tag) if sep and "/" not in tag else (name, None)


def pod_templates(docs: list[dict]):
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS:
            yield doc, doc["spec"]["template"]["spec"]


def all_containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        body, target = yaml.safe_load((directory / patch["path"]).read_text()), patch["target"]
        hits = [n for n, d in enumerate(docs)
                if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"{directory}: patch {patch['path']} matches {len(hits)} documents"
        docs[hits[0]] = strategic_merge(docs[hits[0]], body)
    for image in kustomization.get("images", []):
        for _doc, pod in pod_templates(docs):
            for container in all_containers(pod):
                name, tag = split_image(container["image"])
                if name == image["name"]:
                    tag = image.get("newTag", tag)
                    container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
    return docs



def render_all() -> dict[str, list[dict]]:
    return {name: render(ROOT / path) for name, path in K8S_SETS.items()}


def dockerfile_env() -> dict[str, str]:
    """The image's ENV, from the Dockerfile (KEY=VALUE forms, continued lines joined)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for pair in line[4:].split():
                key, _, value = pair.partition("=")
                env[key] = value
    return env



def dockerfile_chowned() -> set[str]:
    """The paths the Dockerfile hands to the runtime user (`chown 65532:65532 ...`)."""
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return {p for line in dockerfile.splitlines() if "chown 65532:65532" in line
            for p in line.split("chown 65532:65532", 1)[1].split("&&")[0].split()}


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def vmesh_role(container: dict) -> str | None:
    return container["args"][0] if split_image(container["image"])[0].endswith("vmesh") else None
