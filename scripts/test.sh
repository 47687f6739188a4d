#!/usr/bin/env bash
# Builds latentkv and runs every test: the CPU tests always, and with nvcc present the GPU tests too
# (they run where a GPU is and report "skipped" elsewhere). With nvcc present it also compiles every
# CUDA source for each target architecture (sm_89, sm_90a, sm_100a, sm_120a). Then, on CPU builds of
# the host code, the CPU tests once more under AddressSanitizer and UndefinedBehaviorSanitizer
# (build-sanitize/) and the concurrency tests under ThreadSanitizer (build-tsan/); LKV_TEST_SANITIZE=0
# leaves those passes out.
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
  SANITIZE_BUILD=${SANITIZE_BUILD:-build-sanitize}
  TSAN_BUILD=${TSAN_BUILD:-build-tsan}
  echo "== the CPU tests under AddressSanitizer and UndefinedBehaviorSanitizer"
  cmake -S . -B "$SANITIZE_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DLKV_CUDA=OFF -DLKV_SANITIZE=address
  cmake --build "$SANITIZE_BUILD" -j"$JOBS"
  ctest --test-dir "$SANITIZE_BUILD" -L cpu -j"$JOBS" --output-on-failure
  echo "== the concurrency tests under ThreadSanitizer"
  cmake -S . -B "$TSAN_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLKV_CUDA=OFF -DLKV_SANITIZE=thread \
    -DLKV_BUILD_TOOLS=OFF
  cmake --build "$TSAN_BUILD" -j"$JOBS" --target latentkv_tests
  tsan=("$TSAN_BUILD/tests/latentkv_tests" --gtest_filter='Concurrency.*')  # a race reported exits 66
  # ThreadSanitizer's fixed memory layout can collide with a kernel's wide address randomisation:
  # run without it where setarch may turn it off.
  if command -v setarch >/dev/null && setarch "$(uname -m)" -R true 2>/dev/null; then
    tsan=(setarch "$(uname -m)" -R "${tsan[@]}")
  fi
  "${tsan[@]}"
fi
