#include "gpu/matrix_rate.hpp"

#include <cublas_v2.h>

#include <stdexcept>
#include <string>

#include "gpu/kernels.hpp"
#include "gpu/measure.hpp"

namespace latentkv::tools::gpu {
namespace {

void cublas_ok(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("cuBLAS ") + what + ": " + cublasGetStatusString(status));
  }
}

class CublasHandle {
 public:
  CublasHandle() { cublas_ok(cublasCreate(&handle_), "create"); }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle() { cublasDestroy(handle_); }
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

}  // namespace

MatrixRate measure_bf16_matrix_rate(int n, cudaStream_t stream) {
  constexpr int kWarmup = 3, kIters = 10;
  const std::size_t elems = static_cast<std::size_t>(n) * n;
  DeviceMemory a(elems * 2), b(elems * 2), c(elems * 2);  // [n, n] bf16 each
  // Random operands: tensor cores take the same time for any values, but zeros could be skipped
  // by a clever library and NaN could trap; these are neither.
  launch_random_bf16(a.get<std::uint16_t>(), elems, 11, 1.0f, stream);
  launch_random_bf16(b.get<std::uint16_t>(), elems, 13, 1.0f, stream);
  CublasHandle handle;
  cublas_ok(cublasSetStream(handle.get(), stream), "set stream");
  const float alpha = 1.0f, beta = 0.0f;
  const auto gemm = [&](int) {
    cublas_ok(cublasGemmEx(handle.get(), CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(), CUDA_R_16BF, n, b.get(),
                           CUDA_R_16BF, n, &beta, c.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "bf16 GEMM");
  };
  const Timing t = time_calls(gemm, kWarmup, kIters, stream);
  MatrixRate rate;
  rate.tflops = 2.0 * n * static_cast<double>(n) * n / (t.median_us * 1e6);
  rate.how = "cuBLAS bf16 GEMM " + std::to_string(n) + "^3, fp32 accumulate, median of " + std::to_string(kIters);
  return rate;
}

}  // namespace latentkv::tools::gpu
