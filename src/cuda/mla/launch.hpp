// src/cuda/mla/launch.hpp - planning and launching dense and sparse MLA decode.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "latentkv/backend.hpp"
#include "latentkv/ops.hpp"

namespace latentkv::cuda {

// Query tokens per decode call (B, or B x q_len for sparse decode): one grid row (y or z) each.
inline constexpr int kMaxDecodeBatch = static_cast<int>(kMaxGpuRequests);

// The split-KV schedule for these shapes on a device with `multiprocessors` SMs (or p.num_splits,
// when it asks for a count). Depends on the batch, rows (q_len x heads) and block-table capacity
// only, never on the current lengths. `op` names the calling op in errors.
Plan plan_mla_decode(const MlaDecodeParams& p, int multiprocessors, const char* op = "mla_decode");

// Launches decode (and the split combine when p.num_splits > 1). Arguments must be validated;
// p.num_splits must come from plan_mla_decode and p.workspace hold its workspace_bytes. `op` names
// the calling op in errors (a per-token prefill launches it on slices of its new tokens).
void launch_mla_decode(const MlaDecodeParams& p, cudaStream_t stream, const char* op = "mla_decode");

// What every decode launch (decode.cu's kernels and their split combine) asks of its call before it
// queues anything, for `batch` query tokens (requests; B x q_len sparse; a prefill's new tokens or
// groups) of `rows` rows each: a planned split count (1 to 1024), q, o and the cache aligned for the
// kernels' vector accesses, and with batch > 0 the splits' partials within the workspace and at most
// kMaxDecodeBatch query tokens. Throws Error naming `op`. A dense prefill's workspace starts with its
// block tables (`table_bytes` of them, a multiple of 16): the partials follow them, and an error
// gives the whole workspace the caller passed and needs.
struct DecodeCall {
  const char* op = "mla_decode";
  std::int64_t batch = 0;
  std::int64_t rows = 0;
  int num_splits = 1;
  const void* q = nullptr;
  const void* o = nullptr;
  const void* cache = nullptr;
  const void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::size_t table_bytes = 0;
};
void check_decode_call(const DecodeCall& call);
// The same for each op's whole call, its fault record's alignment, and (prefill) every launch it
// would queue: what launch_mla_decode, launch_sparse_mla_decode (`op` names the caller of either),
// launch_mla_prefill and launch_sparse_mla_prefill refuse before they queue anything. They queue
// nothing themselves.
void check_mla_decode_call(const MlaDecodeParams& p, const char* op = "mla_decode");
void check_sparse_mla_decode_call(const SparseMlaDecodeParams& p, const char* op = "sparse_mla_decode");
void check_mla_prefill_call(const MlaPrefillParams& p);
void check_sparse_mla_prefill_call(const SparseMlaPrefillParams& p);

// Sparse MLA decode: the same kernels, each query token attending to its own index row.
Plan plan_sparse_mla_decode(const SparseMlaDecodeParams& p, int multiprocessors, const char* op = "sparse_mla_decode");
// The op a sparse decode launch runs for (sparse prefill launches it on slices of its new tokens):
// its name in errors and fault records, and the slice's first new token (a bad index's element).
struct SparseDecodeCaller {
  const char* op = "sparse_mla_decode";
  DeviceFaultOp fault_op = DeviceFaultOp::kSparseMlaDecode;
  std::int64_t first_row = 0;
};
void launch_sparse_mla_decode(const SparseMlaDecodeParams& p, cudaStream_t stream,
                              const SparseDecodeCaller& caller = {});

// Prefill / extend (prefill.cu): the new tokens as query rows of the decode kernels, each a request
// of its own (sparse; dense where no groups are taken) or in groups (below). Dense
// prefill's workspace also holds each new token's (or group's) block-table row and length.
// Dense prefill on few heads: its new tokens in groups of up to `tokens`, each group a decode
// "request" of tokens x H query rows, so that a CTA's rows are filled (per-token decode runs H rows
// a CTA). mla_prefill_group_tokens() says how many new tokens a group takes for these shapes:
// floor(64 / H) on sm_90a over an fp8 cache with H <= 32 (the wgmma kernel's 64 rows) when the
// groups would hold at least 32 query rows on average; elsewhere over fp8, floor(16 / H) with H <= 8
// (the narrow kernel's 16 rows) for at least 2048 new tokens when the groups would hold at least 1.5
// of them on average; else 1 (per token). For launch_mla_decode_groups, p.q [T, H, 576], p.o and
// p.lse are the prefill's; p.block_table [groups, max_pages] and p.seq_lens [groups] are the
// groups' (prefill_rows.hpp, launch_prefill_groups), and group b's rows are those of its new tokens
// [spans[b].x, spans[b].x + spans[b].y).
struct DecodeGroups {
  const int2* spans = nullptr;  // [groups] device memory
  int groups = 0;
  int tokens = 1;
};
int mla_prefill_group_tokens(const MlaPrefillParams& p);
Plan plan_mla_decode_groups(const MlaDecodeParams& p, const DecodeGroups& g, int multiprocessors);
void launch_mla_decode_groups(const MlaDecodeParams& p, const DecodeGroups& g, cudaStream_t stream);

Plan plan_mla_prefill(const MlaPrefillParams& p, int multiprocessors);
void launch_mla_prefill(const MlaPrefillParams& p, cudaStream_t stream);
Plan plan_sparse_mla_prefill(const SparseMlaPrefillParams& p, int multiprocessors);
// Sparse prefill seen as sparse decode of T one-token requests (the same memory, reshaped views).
SparseMlaDecodeParams as_sparse_decode(const SparseMlaPrefillParams& p);
void launch_sparse_mla_prefill(const SparseMlaPrefillParams& p, cudaStream_t stream);

// The kernel instance a call with these shapes runs on a device of compute capability `sm` (rows =
// q_len x heads dense, heads sparse).
std::string mla_decode_kernel_name(KvDtype dtype, int rows, int sm, bool sparse = false);
std::string mla_prefill_kernel_name(KvDtype dtype, int heads, int sm);

}  // namespace latentkv::cuda
