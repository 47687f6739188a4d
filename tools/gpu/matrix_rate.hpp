// tools/gpu/matrix_rate.hpp - the bf16 matrix rate of this GPU, measured in the run that uses it
// as a floor: a large cuBLAS GEMM, bf16 inputs and output, fp32 accumulation, timed with events.
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

}  // namespace latentkv::tools::gpu
