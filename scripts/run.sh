#!/usr/bin/env bash
# Builds latentkv and runs the main job, `latentkv step`: the attention side of one decode step of a
# whole model, FP8-native against the cast baselines, with the gap of every op to the floors measured
# in the same run (on a GPU: glm5, tp 8, all 78 layers, one request of 32K tokens, a 495K-token pool
# per layer; without one: the CPU reference at a small default). Arguments go to `latentkv step`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
BUILD=${BUILD:-build}
# The CUDA code for this machine's GPU unless LKV_CUDA_ARCHS names architectures: compute capability
# 8.9 -> 89, 9.0 -> 90a, 10.0 -> 100a, 12.0 -> 120a (the library's default is 90a).
if [[ -z "${LKV_CUDA_ARCHS:-}" ]] && command -v nvidia-smi >/dev/null 2>&1; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
  case "$cap" in
    89) LKV_CUDA_ARCHS=89 ;;
    90 | 100 | 120) LKV_CUDA_ARCHS=${cap}a ;;
  esac
fi
ARCHS=()
if [[ -n "${LKV_CUDA_ARCHS:-}" ]]; then ARCHS=(-DLKV_CUDA_ARCHS="$LKV_CUDA_ARCHS"); fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${ARCHS[@]}" >/dev/null
cmake --build "$BUILD" -j"${JOBS:-$(nproc)}" --target latentkv_cli
exec "$BUILD/tools/latentkv" step "$@"
