#include "gpu/matrix_rate.hpp"

#include <cublasLt.h>
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

// Owns a cuBLASLt object created by `create` and released by `destroy`.
template <typename T, cublasStatus_t (*kDestroy)(T)>
class LtObject {
 public:
  LtObject() = default;
  LtObject(const LtObject&) = delete;
  LtObject& operator=(const LtObject&) = delete;
  ~LtObject() {
    if (object_) kDestroy(object_);
  }
  T* out() { return &object_; }
  T get() const { return object_; }

 private:
  T object_ = nullptr;
};

}  // namespace

MatrixRate measure_fp8_matrix_rate(int n, cudaStream_t stream) {
  constexpr int kWarmup = 3, kIters = 10;
  constexpr std::size_t kLtWorkspace = std::size_t{32} << 20;
  const std::size_t elems = static_cast<std::size_t>(n) * n;
  DeviceMemory a(elems), b(elems), d(elems * 2), workspace(kLtWorkspace);
  launch_random_fp8(a.get<std::uint8_t>(), elems, 17, stream);
  launch_random_fp8(b.get<std::uint8_t>(), elems, 19, stream);

  LtObject<cublasLtHandle_t, cublasLtDestroy> handle;
  cublas_ok(cublasLtCreate(handle.out()), "cuBLASLt create");
  LtObject<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> op;
  cublas_ok(cublasLtMatmulDescCreate(op.out(), CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  cublas_ok(cublasLtMatmulDescSetAttribute(op.get(), CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose),
            "transa");
  cublas_ok(cublasLtMatmulDescSetAttribute(op.get(), CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none), "transb");
  LtObject<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> la, lb, ld;
  cublas_ok(cublasLtMatrixLayoutCreate(la.out(), CUDA_R_8F_E4M3, n, n, n), "layout A");
  cublas_ok(cublasLtMatrixLayoutCreate(lb.out(), CUDA_R_8F_E4M3, n, n, n), "layout B");
  cublas_ok(cublasLtMatrixLayoutCreate(ld.out(), CUDA_R_16BF, n, n, n), "layout D");
  LtObject<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> preference;
  cublas_ok(cublasLtMatmulPreferenceCreate(preference.out()), "preference");
  cublas_ok(cublasLtMatmulPreferenceSetAttribute(preference.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &kLtWorkspace, sizeof kLtWorkspace),
            "workspace preference");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  cublas_ok(cublasLtMatmulAlgoGetHeuristic(handle.get(), op.get(), la.get(), lb.get(), ld.get(), ld.get(),
                                           preference.get(), 1, &heuristic, &found),
            "fp8 algorithm heuristic");
  if (found == 0) throw std::runtime_error("cuBLASLt has no fp8 e4m3 GEMM on this device");
  const float alpha = 1.0f, beta = 0.0f;
  const auto gemm = [&](int) {
    cublas_ok(cublasLtMatmul(handle.get(), op.get(), &alpha, a.get(), la.get(), b.get(), lb.get(), &beta, d.get(),
                             ld.get(), d.get(), ld.get(), &heuristic.algo, workspace.get(), kLtWorkspace, stream),
              "fp8 GEMM");
  };
  const Timing t = time_calls(gemm, kWarmup, kIters, stream);
  MatrixRate rate;
  rate.tflops = 2.0 * n * static_cast<double>(n) * n / (t.median_us * 1e6);
  rate.how = "cuBLASLt fp8 e4m3 GEMM " + std::to_string(n) + "^3, fp32 accumulate, bf16 out, median of " +
             std::to_string(kIters) + pacing_note(t);
  return rate;
}

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
  rate.how = "cuBLAS bf16 GEMM " + std::to_string(n) + "^3, fp32 accumulate, median of " + std::to_string(kIters) +
             pacing_note(t);
  return rate;
}

}  // namespace latentkv::tools::gpu
