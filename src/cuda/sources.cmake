# CUDA sources of the library, one folder per op family. Included from the top-level CMakeLists
# when CUDA is enabled.
list(APPEND LKV_SOURCES
  src/cuda/common/backend_support.cpp
  src/cuda/common/device.cpp
  src/cuda/backend.cpp
  src/cuda/baselines/cast_baselines.cpp
  src/cuda/indexer/prefill.cpp
)
set(LKV_CUDA_SOURCES
  src/cuda/common/paging_check.cu
  src/cuda/common/prefill_rows.cu
  src/cuda/common/value_check.cu
  src/cuda/indexer/logits.cu
  src/cuda/kv_cache/append.cu
  src/cuda/kv_cache/cast.cu
  src/cuda/mla/decode.cu
  src/cuda/mla/decode_narrow.cu
  src/cuda/mla/decode_wgmma.cu
  src/cuda/mla/prefill.cu
  src/cuda/topk/select.cu
)
list(APPEND LKV_BACKENDS cuda cast_full gather_cast)
