#!/usr/bin/env bash
# Builds latentkv and runs the main job, `latentkv step`: the attention side of one decode step of a
# whole model, FP8-native against the cast baselines, with the gap of every op to the floors measured
# in the same run (on a GPU: glm5, tp 8, all 78 layers, one request of 32K tokens, a 495K-token pool
# per layer; without one: the CPU reference at a small default). Arguments go to `latentkv step`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
BUILD=${BUILD:-build}
source scripts/cuda_archs.sh  # the CUDA code for this machine's GPU unless LKV_CUDA_ARCHS names architectures
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLKV_CUDA_ARCHS="$LKV_CUDA_ARCHS" >/dev/null
cmake --build "$BUILD" -j"${JOBS:-$(nproc)}" --target latentkv_cli
exec "$BUILD/tools/latentkv" step "$@"
