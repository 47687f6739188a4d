#!/usr/bin/env bash
# Builds latentkv and runs the main job: on a GPU, the FP8-native decode benchmark against the cast
# baselines (glm5, tp 8, one request of 32K tokens, 495K-token pool); without one, the DSA decode
# pipeline of one layer on the CPU reference (small default).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
BUILD=${BUILD:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"${JOBS:-$(nproc)}" --target latentkv_cli
if "$BUILD/tools/latentkv" info | grep -q "^device: cpu"; then
  exec "$BUILD/tools/latentkv" demo "$@"
else
  exec "$BUILD/tools/latentkv" bench "$@"
fi
