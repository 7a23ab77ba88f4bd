#!/usr/bin/env bash
# The GPU path run for real, in one command of at most 8 minutes on one GPU (tools/gpu_check.py says
# what it runs). It writes gpu_check.json and gpu_check.log into the folder given, else $OUT, else
# ./gpu-check-out.
#   tools/gpu_check.sh [OUT_DIR]            on the GPU machine, from the checkout's root, after
#                                           `python tools/gpu_wheels.py` staged .gpu-check/ here
#   tools/gpu_check.sh --dry-run [OUT_DIR]  on a CPU machine with vmesh installed (CI runs it)
# On the GPU machine its python3 (CUDA torch, Triton, transformers) runs everything; the wheels in
# .gpu-check/wheels supply the rest, installed into a folder of their own: that machine has no network.
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=()
if [ "${1:-}" = "--dry-run" ]; then dry_run=(--dry-run); shift; fi
out=${1:-${OUT:-gpu-check-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee "$out/gpu_check.log") 2>&1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1  # progress bars would fill the log
started=$(date +%s)
if [ ${#dry_run[@]} -gt 0 ]; then
    # The list of wheels against pyproject.toml's pins, as the GPU machine would install them.
    "$PY" tools/gpu_wheels.py --check
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    budget=${GPU_CHECK_BUDGET_S:-540}  # no section is skipped for time: a slow CI machine only waits
else
    ls .gpu-check/wheels/*.whl >/dev/null 2>&1 || { echo "no wheels in .gpu-check/wheels: run tools/gpu_wheels.py first" >&2; exit 2; }
    site=${GPU_CHECK_SITE:-/tmp/vmesh-gpu-site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu-check/wheels/*.whl
    # The checkout first (vmesh and tests), then the wheels, then the image's own packages.
    export PYTHONPATH="$PWD:$site"
    export VMESH_CACHE_DIR=${VMESH_CACHE_DIR:-$PWD/.gpu-check/cache}
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    # 8 minutes in all, less what the install took, less a margin for the JSON and the stops.
    budget=$(( ${GPU_CHECK_BUDGET_S:-480} - ($(date +%s) - started) - 20 ))
fi
echo "[gpu_check.sh] python: $("$PY" -c 'import sys; print(sys.version.split()[0])'), budget ${budget} s"
timeout --kill-after=10 $(( budget + 15 )) "$PY" -m tools.gpu_check "${dry_run[@]}" --out "$out" --budget-s "$budget"
