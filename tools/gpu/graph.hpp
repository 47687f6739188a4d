// tools/gpu/graph.hpp - a CUDA graph captured once from a stream and replayed: how `latentkv step`
// runs a whole model's step (hundreds of small kernels) without paying a launch for each.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>

#include "gpu/measure.hpp"

namespace latentkv::tools::gpu {

class Graph {
 public:
  // Captures everything `record` enqueues on `stream` (which must be idle), then instantiates it and
  // uploads it on `stream`. Nothing runs yet. If `record` throws, the capture is ended and discarded
  // and the error passes on.
  Graph(cudaStream_t stream, const std::function<void()>& record) {
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin graph capture");
    try {
      record();
    } catch (...) {
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream, &partial);
      if (partial != nullptr) cudaGraphDestroy(partial);
      cudaGetLastError();  // the capture was invalidated; clear the sticky error for later calls
      throw;
    }
    cuda_ok(cudaStreamEndCapture(stream, &graph_),
            "end graph capture (an op synchronized or allocated inside it?)");
    if (const cudaError_t e = cudaGraphInstantiate(&exec_, graph_, 0); e != cudaSuccess) {
      cudaGraphDestroy(graph_);  // the destructor does not run for a constructor that throws
      cuda_ok(e, "instantiate graph");
    }
    // Uploaded now, so that its first launch (which would upload it) is not a timed one.
    if (const cudaError_t e = cudaGraphUpload(exec_, stream); e != cudaSuccess) {
      cudaGraphExecDestroy(exec_);
      cudaGraphDestroy(graph_);
      cuda_ok(e, "upload graph");
    }
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }

  void launch(cudaStream_t stream) const { cuda_ok(cudaGraphLaunch(exec_, stream), "graph launch"); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace latentkv::tools::gpu
