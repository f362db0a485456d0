#!/usr/bin/env bash
# Builds a stand-in for NVIDIA's CUDA 13 runtime image from what this machine
# has: the Debian 12 base image (make-base-image.sh) plus the CUDA runtime
# libraries of the local toolkit (cudart, cuBLAS, cuBLASLt, NCCL) under
# /usr/local/cuda/lib64, laid out and configured as in
# nvidia/cuda:13.0.0-runtime. For machines that reach no container registry:
# `./dev images cuda` uses it as CUDA_BASE when COLOD_CUDA_BASE_IMAGE is unset
# and docker.io's image is not in podman's storage.
#
#   deploy/container/make-cuda-base-image.sh BASE [TAG]
#       BASE: the Debian 12 image (e.g. localhost/colod-base:bookworm)
#       TAG:  default localhost/colod-cuda-base:13
#
# Environment: COLOD_CUDA_HOME (default /usr/local/cuda). Like NVIDIA's image
# it holds no driver (libcuda.so): the NVIDIA container toolkit mounts the
# host's at run time, and without one the worker reports that no CUDA device
# is present. About 800 MB, nearly all of it cuBLASLt and NCCL.
set -euo pipefail

base=${1:?usage: make-cuda-base-image.sh BASE [TAG]}
tag=${2:-localhost/colod-cuda-base:13}
cuda=${COLOD_CUDA_HOME:-/usr/local/cuda}
command -v podman >/dev/null || { echo "make-cuda-base-image: podman is missing" >&2; exit 1; }
[[ -d $cuda/lib64 ]] || { echo "make-cuda-base-image: no CUDA toolkit at $cuda (set COLOD_CUDA_HOME)" >&2; exit 1; }

ctx=$(mktemp -d /tmp/colod-cuda-base.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/lib64"
# The libraries and their soname links, as NVIDIA's runtime image ships them.
for lib in libcudart libcublas libcublasLt libnccl; do
  found=0
  for f in "$cuda/lib64/$lib".so.*; do
    [[ -e $f ]] || continue
    cp -P "$f" "$ctx/lib64/" && found=1
  done
  ((found)) || { echo "make-cuda-base-image: $cuda/lib64/$lib.so.* not found" >&2; exit 1; }
done
# CUDART_VERSION 13000 -> 13.0
version=$(awk '/#define CUDART_VERSION/ { printf "%d.%d", $3 / 1000, ($3 % 1000) / 10 }' "$cuda/include/cuda_runtime_api.h" 2>/dev/null)
version=${version:-13}

cat >"$ctx/Containerfile" <<CONTAINERFILE
FROM $base
COPY lib64/ /usr/local/cuda/lib64/
RUN echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/000_cuda.conf && ldconfig && \\
    ldconfig -p | grep -q libcublasLt.so && ldconfig -p | grep -q libnccl.so.2
# NVIDIA's runtime images set these; the container toolkit reads the first two.
ENV NVIDIA_VISIBLE_DEVICES=all \\
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \\
    CUDA_VERSION=$version \\
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64
LABEL org.opencontainers.image.title="colod-cuda-base" \\
      org.opencontainers.image.description="Debian 12 + CUDA $version runtime libraries (cudart, cuBLAS, NCCL) from the local toolkit"
CONTAINERFILE
echo "make-cuda-base-image: $tag from $base + CUDA $version libraries of $cuda" >&2
podman build --format docker -f "$ctx/Containerfile" -t "$tag" "$ctx"
