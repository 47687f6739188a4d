// src/core/validate.hpp - argument checks shared by every backend.
//
// validate_shapes() looks only at descriptors and views (dtypes, shapes, devices, scalar fields, and
// the addresses: what a call writes apart from its other arguments) and is what every backend
// calls before launching. validate_values() reads index and input data and so
// needs them in host memory: the reference backend calls it, and device backends may call it on
// host copies. Both throw latentkv::Error naming the op, the argument, the value and what was
// expected; neither writes anything.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>

#include "latentkv/dtype.hpp"
#include "latentkv/ops.hpp"

namespace latentkv::detail {

// Which output dtypes a backend writes: the GPU backends write bf16 o and f32 lse; the reference
// also writes f32/f64 o and f64 lse.
enum class Outputs { kDeviceTypes, kReferenceTypes };

void validate_shapes(const AppendParams& p, Device device);
void validate_shapes(const MlaDecodeParams& p, Device device, Outputs outputs);
void validate_shapes(const MlaPrefillParams& p, Device device, Outputs outputs);
void validate_shapes(const IndexerLogitsParams& p, Device device);
void validate_shapes(const TopkParams& p, Device device);
void validate_shapes(const SparseMlaDecodeParams& p, Device device, Outputs outputs);
void validate_shapes(const SparseMlaPrefillParams& p, Device device, Outputs outputs);
void validate_shapes(const IndexerPrefillParams& p, Device device);

void validate_values(const AppendParams& p);
void validate_values(const MlaDecodeParams& p);
void validate_values(const MlaPrefillParams& p);
void validate_values(const IndexerLogitsParams& p);
void validate_values(const TopkParams& p);
void validate_values(const SparseMlaDecodeParams& p);
void validate_values(const SparseMlaPrefillParams& p);
void validate_values(const IndexerPrefillParams& p);

// A pointer that is not `bytes`-aligned, as an error's value shows it: "an address not 16-byte
// aligned (0x7f12a0000008)".
std::string misaligned_address(const void* pointer, std::size_t bytes);

// The memory a call touches, as byte ranges named for messages: what a call writes (outputs, caches
// it appends to, workspaces, the fault record) shares no byte with anything else it reads or writes.
// Every validate_shapes() checks its op's arguments so; a call of several steps (dsa.cpp) checks its
// own workspace, where the steps' views lie, against the caller's arguments with expect_apart().
struct MemorySpan {
  std::string_view name;
  const void* data = nullptr;
  std::size_t bytes = 0;  // 0 (or null data): nothing to check
  bool written = false;
};
// A view's bytes as a contiguous tensor (none for a descriptor expect_view would refuse).
MemorySpan span_of(std::string_view name, const TensorView& view, bool written);
// A cache's pages (none for a page count or size its checks would refuse).
MemorySpan span_of(std::string_view name, const LatentCache& cache, bool written);
MemorySpan span_of(std::string_view name, const IndexerCache& cache, bool written);
// Throws the Error naming the written span of the first pair that overlaps (a pair of reads may).
void expect_apart(std::string_view op, std::initializer_list<MemorySpan> spans);

// A view's descriptor before anything counts its elements or reads it: a rank it holds, extents
// >= 0, and nonzero extents whose bytes fit int64 (expect_view's first check; dsa.cpp asks it of the
// caller's views before it sizes a workspace from them).
void expect_descriptor(std::string_view op, std::string_view arg, const TensorView& view);

// A prefill's chunk_tokens: 0 (the backend's default) or more (indexer_prefill's check, which
// dsa_prefill makes before a plan's chunk stands in for the caller's).
void expect_chunk_tokens(std::string_view op, std::int64_t chunk_tokens);

// Small helpers for other checks in the same style.
[[noreturn]] void fail(std::string_view op, std::string_view argument, const std::string& value,
                       const std::string& expected);
// "cpu", or "cuda:N": CUDA views and caches must be on the device the call runs on.
std::string device_text(Device d);
std::string describe(const TensorView& view);  // "bf16 [2, 1, 8, 576] on cuda"
// Throws unless lo <= value <= hi: "argument 'q.shape[2] (heads)' = 0: expected 1 .. 128" (+ `what`).
void expect_range(std::string_view op, std::string_view arg, std::int64_t value, std::int64_t lo, std::int64_t hi,
                  const std::string& what = {});
// A decode's q_len (q.shape[1] of mla_decode, sparse_mla_decode and indexer_logits): 1 ..
// kMaxDecodeQLen. The calls check it, and the CUDA plan() before them (backend_support.cpp).
void expect_decode_q_len(std::string_view op, std::int64_t q_len);
// The errors of the value checks, shared by the reference's checks and the GPU's fault records
// (device_fault.cpp), so that both say the same for the same input: a bad slot (element `index` of
// `argument`, outside -1 .. num_slots - 1), a non-finite bf16 or float element, a NaN fp8 code, a
// NaN logit at a position its row sees, a length outside its block table's capacity or past the
// logits' columns, a block-table page outside the pool, and the three ways cu_new_tokens can be
// wrong. A bound they count with outside int32 can only come from a record no latentkv kernel wrote:
// they throw the "device fault" Error naming the record's field instead.
[[noreturn]] void fail_slot(std::string_view op, std::string_view argument, std::int64_t index, std::int64_t slot,
                            std::int64_t num_slots);
// (A finite `bits` is one too large for an fp8 block under a pow2 scale: kPow2StorableMagnitudeBits.)
[[noreturn]] void fail_nonfinite_bf16(std::string_view op, std::string_view argument, std::int64_t index,
                                      std::uint16_t bits);
[[noreturn]] void fail_nonfinite_f32(std::string_view op, std::string_view argument, std::int64_t index, float x);
[[noreturn]] void fail_nan_fp8(std::string_view op, std::string_view argument, std::int64_t index, std::uint8_t code);
[[noreturn]] void fail_nan_logit(std::string_view op, std::int64_t request, std::int64_t row, std::int64_t position);
[[noreturn]] void fail_seq_len(std::string_view op, std::int64_t request, std::int64_t len, std::int64_t max_pages,
                               std::int64_t page_size);
[[noreturn]] void fail_seq_len_columns(std::string_view op, std::int64_t request, std::int64_t len,
                                       std::int64_t max_len);
[[noreturn]] void fail_block_table_page(std::string_view op, std::int64_t request, std::int64_t position,
                                        std::int64_t page, std::int64_t num_pages, std::int64_t len,
                                        std::int64_t page_size);
[[noreturn]] void fail_new_tokens_start(std::string_view op, std::int64_t first);
[[noreturn]] void fail_new_tokens_count(std::string_view op, std::int64_t index, std::int64_t value,
                                        std::int64_t previous, std::int64_t len);
[[noreturn]] void fail_new_tokens_end(std::string_view op, std::int64_t index, std::int64_t value, std::int64_t rows);

}  // namespace latentkv::detail
