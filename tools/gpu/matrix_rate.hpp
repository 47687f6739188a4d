// tools/gpu/matrix_rate.hpp - the matrix rates of this GPU, measured in the run that uses them as a
// floor: a large cuBLAS GEMM (bf16 inputs, or fp8 e4m3 through cuBLASLt), bf16 output, fp32
// accumulation, timed with events.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace latentkv::tools::gpu {

struct MatrixRate {
  double tflops = 0;
  std::string how;  // "cuBLAS bf16 GEMM 8192^3, fp32 accumulate, median of 10"
};

// Times C = A B for n x n x n bf16 matrices; allocates and frees 3 n^2 bf16 values.
MatrixRate measure_bf16_matrix_rate(int n, cudaStream_t stream);

// Times D = A^T B for n x n x n fp8 e4m3 matrices (the layout fp8 GEMMs take), bf16 D; allocates
// 2 n^2 bytes of operands, 2 n^2 of output and cuBLASLt's workspace.
MatrixRate measure_fp8_matrix_rate(int n, cudaStream_t stream);

}  // namespace latentkv::tools::gpu
