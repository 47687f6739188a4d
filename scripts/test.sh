#!/usr/bin/env bash
# Builds latentkv and runs every test: the CPU tests always, and with nvcc present the GPU tests too
# (they run where a GPU is and report "skipped" elsewhere). With nvcc present it also compiles every
# CUDA source for each target architecture (sm_89, sm_90a, sm_100a, sm_120a). Then the CPU tests
# once more, on a CPU build of the host code under AddressSanitizer and UndefinedBehaviorSanitizer
# (in build-sanitize/; LKV_TEST_SANITIZE=0 leaves that pass out).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
BUILD=${BUILD:-build}
JOBS=${JOBS:-$(nproc)}
source scripts/cuda_archs.sh  # the CUDA code for this machine's GPU unless LKV_CUDA_ARCHS names architectures
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLKV_CUDA_ARCHS="$LKV_CUDA_ARCHS"
cmake --build "$BUILD" -j"$JOBS"
if ninja -C "$BUILD" -t query latentkv_cuda_arch_check >/dev/null 2>&1; then  # configured with CUDA
  echo "== compiling the CUDA sources for every target architecture"
  cmake --build "$BUILD" -j"$JOBS" --target latentkv_cuda_arch_check
fi
ctest --test-dir "$BUILD" -j"$JOBS" --output-on-failure
if [ "${LKV_TEST_SANITIZE:-1}" != 0 ]; then
  echo "== the CPU tests under AddressSanitizer and UndefinedBehaviorSanitizer"
  SANITIZE_BUILD=${SANITIZE_BUILD:-build-sanitize}
  cmake -S . -B "$SANITIZE_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DLKV_CUDA=OFF -DLKV_SANITIZE=ON
  cmake --build "$SANITIZE_BUILD" -j"$JOBS"
  ctest --test-dir "$SANITIZE_BUILD" -L cpu -j"$JOBS" --output-on-failure
fi
