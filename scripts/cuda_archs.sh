# scripts/cuda_archs.sh - sourced by run.sh and test.sh. Unless the environment names them, sets
# LKV_CUDA_ARCHS, the architectures the CUDA library holds code for, to this machine's GPU (compute
# capability 8.9 -> 89, 9.0 -> 90a, 10.0 -> 100a, 12.0 -> 120a), or to the library's default, 90a,
# where there is none. Both scripts pass it to every configure, so that a build folder configured
# before for other architectures follows.
if [[ -z "${LKV_CUDA_ARCHS:-}" ]]; then
  LKV_CUDA_ARCHS=90a
  if command -v nvidia-smi >/dev/null 2>&1; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
    case "$cap" in
      89) LKV_CUDA_ARCHS=89 ;;
      90 | 100 | 120) LKV_CUDA_ARCHS=${cap}a ;;
    esac
  fi
fi
