// src/cpu/reference.hpp - the CPU reference backend's ops.
//
// Naive on purpose: float64 arithmetic over the dequantized bytes of the cache, its own index
// arithmetic, no tiling. Every function checks its arguments completely (shapes and values: slots,
// lengths, block tables, NaN/inf inputs) before writing anything, so a rejected call changes no
// cache and no output. All tensors live in host memory.
#pragma once

#include "latentkv/ops.hpp"

namespace latentkv::cpu {

void append(const AppendParams& p);
void mla_decode(const MlaDecodeParams& p);
void mla_prefill(const MlaPrefillParams& p);
void indexer_logits(const IndexerLogitsParams& p);
void topk(const TopkParams& p);
void sparse_mla_decode(const SparseMlaDecodeParams& p);
void sparse_mla_prefill(const SparseMlaPrefillParams& p);
void indexer_prefill(const IndexerPrefillParams& p);

// Dequantized entries of the main cache, as the kernels read them: 576 values (512 latent, 64 rope).
void dequantize_token(const LatentCache& cache, std::int64_t slot, double* out576);
// The 128 indexer key values of a slot times its scale is what the kernels use; these return both parts.
void dequantize_indexer_key(const IndexerCache& cache, std::int64_t slot, double* out128, double* scale);

}  // namespace latentkv::cpu
