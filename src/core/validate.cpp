#include "validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "latentkv/error.hpp"
#include "latentkv/fp8.hpp"

namespace latentkv::detail {

void fail(std::string_view op, std::string_view argument, const std::string& value, const std::string& expected) {
  throw Error(std::string(op), std::string(argument), value, expected);
}

namespace {

// The bounds these errors count with are int32 quantities (slots, pages, lengths, offsets) wherever a
// check or a latentkv kernel found the fault. A fault record that was not zeroed, or that no latentkv
// kernel wrote, can hold any int64 there: such a field is named as the record's (throw_device_fault)
// before any arithmetic on it.
void expect_record_field(std::string_view field, std::int64_t value, std::int64_t lo) {
  if (value < lo || value > INT32_MAX) {
    fail("device fault", field, std::to_string(value),
         std::to_string(lo) + " .. " + std::to_string(INT32_MAX) +
             " (the record is not one a latentkv kernel wrote, or it was not zeroed)");
  }
}

}  // namespace

void fail_slot(std::string_view op, std::string_view argument, std::int64_t index, std::int64_t slot,
               std::int64_t num_slots) {
  expect_record_field("bound", num_slots, 1);
  fail(op, std::string(argument) + " element " + std::to_string(index), std::to_string(slot),
       "-1 (none) or a slot in 0 .. " + std::to_string(num_slots - 1));
}

void fail_nonfinite_bf16(std::string_view op, std::string_view argument, std::int64_t index, std::uint16_t bits) {
  const std::string where = std::string(argument) + " element " + std::to_string(index);
  if ((bits & 0x7F80u) != 0x7F80u) {  // finite: too large for an fp8 block under a pow2 scale
    char value[32];
    std::snprintf(value, sizeof value, "%.6g", static_cast<double>(bf16_decode(bits)));
    fail(op, where, value,
         "a magnitude below 248 x 2^120 (3.29649e+38): with pow2 scales a larger value is stored as the fp8 code 256 "
         "under the scale 2^120, which is inf in float32 (scale_mode exact holds it)");
  }
  const char* value = std::isnan(bf16_decode(bits)) ? "nan" : (bits & 0x8000u) != 0 ? "-inf" : "inf";
  fail(op, where, value, "a finite value");
}

void fail_nonfinite_f32(std::string_view op, std::string_view argument, std::int64_t index, float x) {
  fail(op, std::string(argument) + " element " + std::to_string(index), std::to_string(x), "a finite value");
}

void fail_nan_fp8(std::string_view op, std::string_view argument, std::int64_t index, std::uint8_t code) {
  constexpr char kHex[] = "0123456789abcdef";
  const std::string hex = {kHex[code >> 4], kHex[code & 15]};
  fail(op, std::string(argument) + " element " + std::to_string(index), "nan (fp8 code 0x" + hex + ")", "a finite value");
}

void fail_nan_logit(std::string_view op, std::int64_t request, std::int64_t row, std::int64_t position) {
  fail(op, "logits[" + std::to_string(request) + "][" + std::to_string(row) + "][" + std::to_string(position) + "]",
       "nan", "a number (visible position)");
}

void fail_seq_len(std::string_view op, std::int64_t request, std::int64_t len, std::int64_t max_pages,
                  std::int64_t page_size) {
  expect_record_field("pages", max_pages, 0);
  expect_record_field("page_size", page_size, 1);
  fail(op, "seq_lens[" + std::to_string(request) + "]", std::to_string(len),
       "0 .. " + std::to_string(max_pages * page_size) + " (block table capacity: " + std::to_string(max_pages) +
           " pages x " + std::to_string(page_size) + " tokens)");
}

void fail_seq_len_columns(std::string_view op, std::int64_t request, std::int64_t len, std::int64_t max_len) {
  fail(op, "seq_lens[" + std::to_string(request) + "]", std::to_string(len),
       "<= " + std::to_string(max_len) + " (the logits' max_len columns)");
}

void fail_block_table_page(std::string_view op, std::int64_t request, std::int64_t position, std::int64_t page,
                           std::int64_t num_pages, std::int64_t len, std::int64_t page_size) {
  expect_record_field("bound", num_pages, 1);
  expect_record_field("length", len, 0);
  expect_record_field("page_size", page_size, 1);
  const std::int64_t used = (len + page_size - 1) / page_size;
  fail(op, "block_table[" + std::to_string(request) + "][" + std::to_string(position) + "]", std::to_string(page),
       "a page id in 0 .. " + std::to_string(num_pages - 1) + " (request " + std::to_string(request) + " uses " +
           std::to_string(used) + " pages for " + std::to_string(len) + " tokens)");
}

void fail_new_tokens_start(std::string_view op, std::int64_t first) {
  fail(op, "cu_new_tokens[0]", std::to_string(first), "0");
}

void fail_new_tokens_count(std::string_view op, std::int64_t index, std::int64_t value, std::int64_t previous,
                           std::int64_t len) {
  expect_record_field("bound", previous, INT32_MIN);
  expect_record_field("length", len, INT32_MIN);
  fail(op, "cu_new_tokens[" + std::to_string(index) + "]", std::to_string(value),
       std::to_string(previous) + " .. " + std::to_string(previous + len) + " (request " + std::to_string(index - 1) +
           " has " + std::to_string(len) + " tokens in all)");
}

void fail_new_tokens_end(std::string_view op, std::int64_t index, std::int64_t value, std::int64_t rows) {
  fail(op, "cu_new_tokens[" + std::to_string(index) + "]", std::to_string(value),
       std::to_string(rows) + " (the rows of q)");
}

std::string device_text(Device d) {
  if (d.kind == DeviceKind::kCpu) return "cpu";
  if (d.kind == DeviceKind::kCuda) return "cuda:" + std::to_string(d.index);
  return "device kind " + std::to_string(static_cast<int>(d.kind)) + " (not cpu or cuda)";
}

namespace {

// A view with no elements needs no memory: PyTorch, for one, gives an empty tensor a null data
// pointer. Any other view with null data is absent.
bool empty_view(const TensorView& v) { return v.rank > 0 && v.numel() == 0; }

bool same_device(Device have, Device want) {
  return have.kind == want.kind && (want.kind == DeviceKind::kCpu || have.index == want.index);
}

}  // namespace

std::string describe(const TensorView& v) {
  if (!v.present() && !empty_view(v)) return "absent";
  return std::string(dtype_name(v.dtype)) + " " + v.shape_string() + " on " + device_text(v.device);
}

std::string misaligned_address(const void* pointer, std::size_t bytes) {
  char address[32];
  std::snprintf(address, sizeof address, "%p", pointer);
  return "an address not " + std::to_string(bytes) + "-byte aligned (" + address + ")";
}

MemorySpan span_of(std::string_view name, const TensorView& v, bool written) {
  // The bytes of a contiguous view; none for a descriptor that expect_view would refuse (a rank it
  // cannot hold, a negative extent, a count that wraps), so that this may be asked before it.
  std::int64_t bytes = v.present() && v.rank >= 0 && v.rank <= TensorView::kMaxRank
                           ? static_cast<std::int64_t>(dtype_size(v.dtype))
                           : 0;
  for (int d = 0; d < v.rank && bytes > 0; ++d) {
    const std::int64_t extent = v.shape[static_cast<std::size_t>(d)];
    if (extent < 0 || __builtin_mul_overflow(bytes, extent, &bytes)) bytes = 0;
  }
  return {name, v.data, static_cast<std::size_t>(bytes), written};
}

namespace {

// Pages whose slots fit int32, as expect_cache asks.
bool countable_pages(std::int64_t num_pages, int page_size) {
  return page_size >= 1 && num_pages >= 1 && num_pages <= INT32_MAX / page_size;
}

}  // namespace

MemorySpan span_of(std::string_view name, const LatentCache& c, bool written) {
  const bool known =
      countable_pages(c.num_pages, c.page_size) && (c.dtype == KvDtype::kFp8E4M3 || c.dtype == KvDtype::kBf16);
  return {name, c.data, known ? c.bytes() : 0, written};
}

MemorySpan span_of(std::string_view name, const IndexerCache& c, bool written) {
  return {name, c.data, countable_pages(c.num_pages, c.page_size) ? c.bytes() : 0, written};
}

namespace {

std::string byte_range(const MemorySpan& s) {  // "16384 bytes at 0x7f12a0000000"
  char text[64];
  std::snprintf(text, sizeof text, "%llu bytes at 0x%llx", static_cast<unsigned long long>(s.bytes),
                static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(s.data)));
  return text;
}

bool overlap(const MemorySpan& a, const MemorySpan& b) {
  if (a.data == nullptr || b.data == nullptr || a.bytes == 0 || b.bytes == 0) return false;
  const auto a0 = reinterpret_cast<std::uintptr_t>(a.data), b0 = reinterpret_cast<std::uintptr_t>(b.data);
  return a0 <= b0 ? b0 - a0 < a.bytes : a0 - b0 < b.bytes;  // no sum that could wrap
}

MemorySpan fault_span(const DeviceFault* fault) { return {"fault", fault, sizeof(DeviceFault), true}; }

// The caller's workspace, refused where it claims bytes at a null address (every op that takes one:
// a plan that asks for none still does not make `workspace_bytes` of nothing a valid argument).
MemorySpan workspace_span(std::string_view op, void* workspace, std::size_t bytes) {
  if (bytes > 0 && workspace == nullptr) {
    fail(op, "workspace", "null", std::to_string(bytes) + " bytes (workspace_bytes)");
  }
  return {"workspace", workspace, bytes, true};
}

}  // namespace

void expect_apart(std::string_view op, std::initializer_list<MemorySpan> spans) {
  for (auto a = spans.begin(); a != spans.end(); ++a) {
    for (auto b = a + 1; b != spans.end(); ++b) {
      if (!(a->written || b->written) || !overlap(*a, *b)) continue;
      const MemorySpan& w = a->written ? *a : *b;
      const MemorySpan& other = a->written ? *b : *a;
      fail(op, w.name, byte_range(w),
           "memory apart from " + std::string(other.name) + " (" + byte_range(other) +
               "): what a call writes shares no byte with its other arguments");
    }
  }
}

// A wrapped count could pass a null view as empty. Nonzero extents count beside a zero one too:
// strides are their products ([0, 2^62, 576] has a stride of 576 x 2^62).
void expect_descriptor(std::string_view op, std::string_view arg, const TensorView& v) {
  if (v.rank < 0 || v.rank > TensorView::kMaxRank) {
    fail(op, arg, "rank " + std::to_string(v.rank), "0 .. " + std::to_string(TensorView::kMaxRank) + " dims");
  }
  std::int64_t bytes = static_cast<std::int64_t>(dtype_size(v.dtype));
  if (bytes == 0) {  // not a DType: its extents would go unbounded (the overflow check counts bytes)
    fail(op, arg, "dtype " + std::to_string(static_cast<int>(v.dtype)),
         "a latentkv::DType (f64, f32, bf16, fp8_e4m3, i32, u8)");
  }
  for (int d = 0; d < v.rank; ++d) {
    const std::int64_t extent = v.shape[static_cast<std::size_t>(d)];
    if (extent < 0) fail(op, arg, v.shape_string(), "extents >= 0");
    if (extent != 0 && __builtin_mul_overflow(bytes, extent, &bytes)) {
      fail(op, arg, v.shape_string(), "a shape whose size in bytes fits 64 bits");
    }
  }
}

namespace {

constexpr std::int64_t kAny = -1;

std::string shape_text(std::initializer_list<std::int64_t> dims, std::initializer_list<const char*> names) {
  std::string s = "[";
  auto n = names.begin();
  for (std::int64_t d : dims) {
    if (s.size() > 1) s += ", ";
    s += d == kAny ? std::string(n != names.end() ? *n : "*") : std::to_string(d);
    if (n != names.end()) ++n;
  }
  return s + "]";
}

// Checks a required view: present (or empty), one of `dtypes`, contiguous, on `device`, and shaped
// `dims` (kAny matches any extent; `names` spell the dims out in the message).
void expect_view(std::string_view op, std::string_view arg, const TensorView& v, std::initializer_list<DType> dtypes,
                 std::initializer_list<std::int64_t> dims, std::initializer_list<const char*> names, Device device) {
  expect_descriptor(op, arg, v);
  const std::string want_shape = shape_text(dims, names);
  std::string want_types;
  for (DType t : dtypes) want_types += (want_types.empty() ? "" : " or ") + std::string(dtype_name(t));
  const std::string expected = want_types + " " + want_shape + " on " + device_text(device);
  if (!v.present() && !empty_view(v)) fail(op, arg, "absent (null data)", expected);
  bool type_ok = false;
  for (DType t : dtypes) type_ok |= v.dtype == t;
  if (!type_ok) fail(op, arg, describe(v), expected);
  if (v.rank != static_cast<int>(dims.size())) fail(op, arg, describe(v), expected);
  int d = 0;
  for (std::int64_t want : dims) {
    const std::int64_t got = v.shape[static_cast<std::size_t>(d++)];
    if (got < 0 || (want != kAny && got != want)) fail(op, arg, describe(v), expected);
  }
  if (!same_device(v.device, device)) fail(op, arg, describe(v), expected);
  if (!v.is_contiguous()) fail(op, arg, describe(v) + " (strided)", "a contiguous tensor");
  // Every backend reads and writes the elements in place, as their type: an address that is not a
  // multiple of the element's size is undefined behaviour on the CPU and a fault on the GPU.
  const std::size_t element = dtype_size(v.dtype);
  if (v.present() && reinterpret_cast<std::uintptr_t>(v.data) % element != 0) {
    fail(op, arg, describe(v) + ", " + misaligned_address(v.data, element),
         "an address aligned to " + std::to_string(element) + " bytes (the size of its elements)");
  }
}

}  // namespace

void expect_range(std::string_view op, std::string_view arg, std::int64_t value, std::int64_t lo, std::int64_t hi,
                  const std::string& what) {
  if (value < lo || value > hi) {
    fail(op, arg, std::to_string(value), std::to_string(lo) + " .. " + std::to_string(hi) + what);
  }
}

void expect_decode_q_len(std::string_view op, std::int64_t q_len) {
  expect_range(op, "q.shape[1] (q_len)", q_len, 1, kMaxDecodeQLen);
}

namespace {

// The split count asked of a plan or set from one: 0 (the plan's choice) to kMaxSplits, whichever
// backend runs the call (the reference ignores it; a GPU call also refuses 0, which plan() fills in),
// so that a count the GPU would refuse fails on the CPU too.
void expect_splits(std::string_view op, int num_splits) {
  expect_range(op, "num_splits", num_splits, 0, kMaxSplits, " (0: the plan's choice)");
}

void expect_scale(std::string_view op, float scale) {
  if (!(std::isfinite(scale) && scale > 0.0f)) {
    char text[32];  // every digit a float needs: -1e-09 must not read as -0.000000
    std::snprintf(text, sizeof text, "%.9g", scale);
    fail(op, "softmax_scale", text, "a finite value > 0");
  }
}

// A paged cache (LatentCache or IndexerCache): memory, a page size, pages whose slots fit int32, on
// the op's device. `what` names it in messages ("latent", "indexer").
template <typename Cache>
void expect_cache(std::string_view op, const Cache& c, const char* what, Device device) {
  if (c.data == nullptr) fail(op, "cache.data", "null", std::string("the ") + what + " cache's memory");
  if (c.page_size < 1) fail(op, "cache.page_size", std::to_string(c.page_size), ">= 1");
  if (c.num_pages < 1) fail(op, "cache.num_pages", std::to_string(c.num_pages), ">= 1");
  if (c.num_pages > INT32_MAX / c.page_size) {  // the product itself could wrap
    fail(op, "cache.num_pages", std::to_string(c.num_pages),
         "num_pages * page_size < 2^31 (slots are int32; page_size " + std::to_string(c.page_size) + ")");
  }
  if (!same_device(c.device, device)) {
    fail(op, "cache.device", device_text(c.device), device_text(device) + " memory");
  }
}

void expect_latent_cache(std::string_view op, const LatentCache& c, Device device) {
  expect_cache(op, c, "latent", device);
  if (c.dtype != KvDtype::kFp8E4M3 && c.dtype != KvDtype::kBf16) {
    fail(op, "cache.dtype", std::to_string(static_cast<int>(c.dtype)), "KvDtype::kFp8E4M3 or KvDtype::kBf16");
  }
}

void expect_indexer_cache(std::string_view op, const IndexerCache& c, Device device) {
  expect_cache(op, c, "indexer", device);
}

// The decode/prefill outputs' allowed dtypes.
std::initializer_list<DType> o_types(Outputs outputs) {
  static const std::initializer_list<DType> device_types = {DType::kBF16};
  static const std::initializer_list<DType> reference_types = {DType::kBF16, DType::kF32, DType::kF64};
  return outputs == Outputs::kDeviceTypes ? device_types : reference_types;
}
std::initializer_list<DType> lse_types(Outputs outputs) {
  static const std::initializer_list<DType> device_types = {DType::kF32};
  static const std::initializer_list<DType> reference_types = {DType::kF32, DType::kF64};
  return outputs == Outputs::kDeviceTypes ? device_types : reference_types;
}

// Paged-attention arguments common to the dense ops, the indexer and top-k.
void expect_paging(std::string_view op, const TensorView& block_table, const TensorView& seq_lens, std::int64_t batch,
                   Device device) {
  expect_view(op, "block_table", block_table, {DType::kI32}, {batch, kAny}, {"B", "max_pages"}, device);
  expect_view(op, "seq_lens", seq_lens, {DType::kI32}, {batch}, {"B"}, device);
}

// The block table's capacity (max_pages x page_size tokens) at most kMaxTableTokens (2^30): lengths
// and the GPU's token positions are int32, and stay so when a kernel rounds them up by a tile or a
// split.
void expect_capacity(std::string_view op, const TensorView& block_table, std::int64_t page_size) {
  if (block_table.size(1) > kMaxTableTokens / page_size) {
    fail(op, "block_table", describe(block_table),
         "max_pages * page_size <= 2^30 (page_size " + std::to_string(page_size) + ")");
  }
}

// Logits columns within int32.
// At most 2^30 logits columns (a row of 4 GiB; a pool holds fewer than 2^31 slots in all): the GPU
// kernels count columns, turns and their grid-strided positions in int32, which 2^31 - 1 columns
// would overflow.
void expect_columns(std::string_view op, const TensorView& logits) {
  if (logits.size(2) > kMaxLogitsColumns) {
    fail(op, "logits", describe(logits), "max_len <= 2^30 columns");
  }
}

// seq_lens within [0, capacity] and the block-table pages they use within the pool.
void check_paging_values(std::string_view op, const TensorView& block_table, const TensorView& seq_lens,
                         int page_size, std::int64_t num_pages) {
  const std::int64_t batch = seq_lens.size(0);
  const std::int64_t max_pages = block_table.size(1);
  const auto* table = block_table.as<const std::int32_t>();
  const auto* lens = seq_lens.as<const std::int32_t>();
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t len = lens[b];
    if (len < 0 || len > max_pages * page_size) fail_seq_len(op, b, len, max_pages, page_size);
    const std::int64_t used = (len + page_size - 1) / page_size;
    for (std::int64_t p = 0; p < used; ++p) {
      const std::int32_t page = table[b * max_pages + p];
      if (page < 0 || page >= num_pages) fail_block_table_page(op, b, p, page, num_pages, len, page_size);
    }
  }
}

void check_finite_bf16(std::string_view op, std::string_view arg, const TensorView& v) {
  const auto* bits = v.as<const std::uint16_t>();
  for (std::int64_t i = 0; i < v.numel(); ++i) {
    if ((bits[i] & 0x7F80u) == 0x7F80u) fail_nonfinite_bf16(op, arg, i, bits[i]);
  }
}

// The values an append stores: finite, and those of rows' first `quantized` elements (of `width`)
// also below kPow2StorableMagnitudeBits in magnitude when they go into fp8 blocks under pow2 scales.
void check_storable_bf16(std::string_view op, std::string_view arg, const TensorView& v, std::int64_t width,
                         std::int64_t quantized, bool pow2) {
  const auto* bits = v.as<const std::uint16_t>();
  const std::uint32_t quantized_limit = pow2 ? kPow2StorableMagnitudeBits : 0x7F80u;
  for (std::int64_t i = 0; i < v.numel(); ++i) {
    const std::uint32_t limit = i % width < quantized ? quantized_limit : 0x7F80u;
    if ((bits[i] & 0x7FFFu) >= limit) fail_nonfinite_bf16(op, arg, i, bits[i]);
  }
}

void check_finite_f32(std::string_view op, std::string_view arg, const TensorView& v) {
  const auto* x = v.as<const float>();
  for (std::int64_t i = 0; i < v.numel(); ++i) {
    if (!std::isfinite(x[i])) fail_nonfinite_f32(op, arg, i, x[i]);
  }
}

// cu_new_tokens ascending from 0 to `rows`, each request's new tokens no more than its length.
void check_new_tokens(std::string_view op, const TensorView& cu_new_tokens, const TensorView& seq_lens,
                      std::int64_t rows) {
  const auto* cu = cu_new_tokens.as<const std::int32_t>();
  const auto* lens = seq_lens.as<const std::int32_t>();
  const std::int64_t b = seq_lens.size(0);
  if (cu[0] != 0) fail_new_tokens_start(op, cu[0]);
  for (std::int64_t i = 0; i < b; ++i) {
    const std::int64_t n = static_cast<std::int64_t>(cu[i + 1]) - cu[i];
    if (n < 0 || n > lens[i]) fail_new_tokens_count(op, i + 1, cu[i + 1], cu[i], lens[i]);
  }
  if (cu[b] != rows) fail_new_tokens_end(op, b, cu[b], rows);
}

void check_fp8_finite(std::string_view op, std::string_view arg, const TensorView& v) {
  const auto* codes = v.as<const std::uint8_t>();
  for (std::int64_t i = 0; i < v.numel(); ++i) {
    if ((codes[i] & 0x7F) == 0x7F) fail_nan_fp8(op, arg, i, codes[i]);
  }
}

void check_slots(std::string_view op, std::string_view arg, const TensorView& slots, std::int64_t num_slots) {
  const auto* s = slots.as<const std::int32_t>();
  for (std::int64_t i = 0; i < slots.numel(); ++i) {
    if (s[i] < -1 || s[i] >= num_slots) fail_slot(op, arg, i, s[i], num_slots);
  }
}

// The slots an append writes (-1 aside) are distinct: two tokens at one slot have no defined entry.
// Names the first element, in the call's order, whose slot an earlier element has.
void check_distinct_slots(std::string_view op, std::string_view arg, const TensorView& slots) {
  const auto* s = slots.as<const std::int32_t>();
  std::vector<std::pair<std::int32_t, std::int64_t>> order;  // (slot, element)
  order.reserve(static_cast<std::size_t>(slots.numel()));
  for (std::int64_t i = 0; i < slots.numel(); ++i) {
    if (s[i] >= 0) order.emplace_back(s[i], i);
  }
  std::sort(order.begin(), order.end());
  std::int64_t later = -1, earlier = -1;  // the earliest repeat, and the first element of its slot
  std::size_t run = 0;                    // where the current slot's elements start, in call order
  for (std::size_t k = 1; k < order.size(); ++k) {
    if (order[k].first != order[run].first) {
      run = k;
    } else if (later < 0 || order[k].second < later) {
      later = order[k].second;
      earlier = order[run].second;
    }
  }
  if (later >= 0) {
    fail(op, std::string(arg) + " element " + std::to_string(later), std::to_string(s[later]),
         "a slot no other token of the call has (element " + std::to_string(earlier) +
             " has it too; the slots of one append must be distinct)");
  }
}

}  // namespace

void expect_chunk_tokens(std::string_view op, std::int64_t chunk_tokens) {
  if (chunk_tokens < 0) fail(op, "chunk_tokens", std::to_string(chunk_tokens), ">= 0 (0: the backend's default)");
}

// ---------------------------------------------------------------------------------------------
// Shapes

void validate_shapes(const AppendParams& p, Device device) {
  constexpr std::string_view op = "append";
  expect_latent_cache(op, p.cache, device);
  if (p.scale_mode != ScaleMode::kPow2 && p.scale_mode != ScaleMode::kExact) {
    fail(op, "scale_mode", std::to_string(static_cast<int>(p.scale_mode)), "ScaleMode::kPow2 or ScaleMode::kExact");
  }
  expect_view(op, "latent", p.latent, {DType::kBF16}, {kAny, kQkDim}, {"n"}, device);
  const std::int64_t n = p.latent.size(0);
  expect_view(op, "slots", p.slots, {DType::kI32}, {n}, {"n"}, device);
  if (p.indexer.data != nullptr) {
    if (p.indexer.page_size != p.cache.page_size) {
      fail(op, "indexer.page_size", std::to_string(p.indexer.page_size),
           std::to_string(p.cache.page_size) + " (the main cache's: both caches share slots)");
    }
    if (p.indexer.num_pages != p.cache.num_pages) {
      fail(op, "indexer.num_pages", std::to_string(p.indexer.num_pages),
           std::to_string(p.cache.num_pages) + " (the main cache's: both caches share slots)");
    }
    if (!same_device(p.indexer.device, device)) {
      fail(op, "indexer.device", device_text(p.indexer.device), device_text(device) + " memory");
    }
    expect_view(op, "indexer_keys", p.indexer_keys, {DType::kBF16}, {n, kIndexerDim}, {"n"}, device);
  } else if (p.indexer_keys.present()) {
    fail(op, "indexer", "absent", "an indexer cache to write the given indexer_keys into");
  }
  expect_apart(op, {span_of("cache.data", p.cache, true),
                    span_of("indexer.data", p.indexer, true),
                    fault_span(p.fault), span_of("latent", p.latent, false), span_of("slots", p.slots, false),
                    span_of("indexer_keys", p.indexer_keys, false)});
}

void validate_shapes(const MlaDecodeParams& p, Device device, Outputs outputs) {
  constexpr std::string_view op = "mla_decode";
  expect_view(op, "q", p.q, {DType::kBF16}, {kAny, kAny, kAny, kQkDim}, {"B", "q_len", "H"}, device);
  const std::int64_t b = p.q.size(0), q_len = p.q.size(1), h = p.q.size(2);
  expect_decode_q_len(op, q_len);
  expect_range(op, "q.shape[2] (heads)", h, 1, kMaxHeads);
  expect_latent_cache(op, p.cache, device);
  expect_paging(op, p.block_table, p.seq_lens, b, device);
  expect_capacity(op, p.block_table, p.cache.page_size);
  expect_view(op, "o", p.o, o_types(outputs), {b, q_len, h, kLatentDim}, {}, device);
  expect_view(op, "lse", p.lse, lse_types(outputs), {b, q_len, h}, {}, device);
  expect_scale(op, p.softmax_scale);
  expect_splits(op, p.num_splits);
  expect_apart(op, {span_of("o", p.o, true), span_of("lse", p.lse, true),
                    workspace_span(op, p.workspace, p.workspace_bytes), fault_span(p.fault),
                    span_of("q", p.q, false), span_of("cache.data", p.cache, false),
                    span_of("block_table", p.block_table, false), span_of("seq_lens", p.seq_lens, false)});
}

void validate_shapes(const MlaPrefillParams& p, Device device, Outputs outputs) {
  constexpr std::string_view op = "mla_prefill";
  expect_view(op, "q", p.q, {DType::kBF16}, {kAny, kAny, kQkDim}, {"T", "H"}, device);
  const std::int64_t t = p.q.size(0), h = p.q.size(1);
  expect_range(op, "q.shape[1] (heads)", h, 1, kMaxHeads);
  expect_view(op, "cu_new_tokens", p.cu_new_tokens, {DType::kI32}, {kAny}, {"B + 1"}, device);
  const std::int64_t b = p.cu_new_tokens.size(0) - 1;
  if (b < 0) fail(op, "cu_new_tokens", describe(p.cu_new_tokens), "i32 [B + 1] with B >= 0");
  expect_latent_cache(op, p.cache, device);
  expect_paging(op, p.block_table, p.seq_lens, b, device);
  expect_capacity(op, p.block_table, p.cache.page_size);
  expect_view(op, "o", p.o, o_types(outputs), {t, h, kLatentDim}, {}, device);
  expect_view(op, "lse", p.lse, lse_types(outputs), {t, h}, {}, device);
  expect_scale(op, p.softmax_scale);
  expect_splits(op, p.num_splits);
  expect_apart(op, {span_of("o", p.o, true), span_of("lse", p.lse, true),
                    workspace_span(op, p.workspace, p.workspace_bytes), fault_span(p.fault),
                    span_of("q", p.q, false), span_of("cache.data", p.cache, false),
                    span_of("block_table", p.block_table, false), span_of("seq_lens", p.seq_lens, false),
                    span_of("cu_new_tokens", p.cu_new_tokens, false)});
}

void validate_shapes(const IndexerLogitsParams& p, Device device) {
  constexpr std::string_view op = "indexer_logits";
  expect_view(op, "q", p.q, {DType::kFP8E4M3}, {kAny, kAny, kAny, kIndexerDim}, {"B", "q_len", "Hi"}, device);
  const std::int64_t b = p.q.size(0), q_len = p.q.size(1), hi = p.q.size(2);
  expect_decode_q_len(op, q_len);
  expect_range(op, "q.shape[2] (indexer heads)", hi, 1, kMaxIndexerHeads);
  expect_view(op, "weights", p.weights, {DType::kF32}, {b, q_len, hi}, {}, device);
  expect_indexer_cache(op, p.cache, device);
  expect_paging(op, p.block_table, p.seq_lens, b, device);
  expect_capacity(op, p.block_table, p.cache.page_size);
  expect_view(op, "logits", p.logits, {DType::kF32}, {b, q_len, kAny}, {"B", "q_len", "max_len"}, device);
  expect_columns(op, p.logits);
  if (p.clear_bytes > 0) {
    if (p.clear == nullptr) fail(op, "clear", "null", std::to_string(p.clear_bytes) + " bytes to zero (clear_bytes)");
    if (p.clear_bytes % 16 != 0) fail(op, "clear_bytes", std::to_string(p.clear_bytes), "a multiple of 16");
    if (reinterpret_cast<std::uintptr_t>(p.clear) % 16 != 0) {
      fail(op, "clear", misaligned_address(p.clear, 16), "16-byte aligned");
    }
  }
  expect_apart(op, {span_of("logits", p.logits, true), MemorySpan{"clear", p.clear, p.clear_bytes, true},
                    workspace_span(op, p.workspace, p.workspace_bytes), fault_span(p.fault),
                    span_of("q", p.q, false), span_of("weights", p.weights, false),
                    span_of("cache.data", p.cache, false),
                    span_of("block_table", p.block_table, false), span_of("seq_lens", p.seq_lens, false)});
}

void validate_shapes(const TopkParams& p, Device device) {
  constexpr std::string_view op = "topk";
  expect_view(op, "logits", p.logits, {DType::kF32}, {kAny, kAny, kAny}, {"B", "q_len", "max_len"}, device);
  const std::int64_t b = p.logits.size(0), q_len = p.logits.size(1);
  expect_range(op, "logits.shape[1] (q_len)", q_len, 1, kMaxDecodeQLen);
  expect_range(op, "k", p.k, 1, kMaxTopk, " (the DSA index_topk limit)");
  if (p.page_size < 1) fail(op, "page_size", std::to_string(p.page_size), ">= 1 (the caches' page size: set it)");
  expect_paging(op, p.block_table, p.seq_lens, b, device);
  expect_capacity(op, p.block_table, p.page_size);
  expect_columns(op, p.logits);
  expect_view(op, "slots", p.slots, {DType::kI32}, {b, q_len, p.k}, {}, device);
  expect_apart(op, {span_of("slots", p.slots, true), workspace_span(op, p.workspace, p.workspace_bytes),
                    fault_span(p.fault), span_of("logits", p.logits, false),
                    span_of("block_table", p.block_table, false), span_of("seq_lens", p.seq_lens, false)});
}

void validate_shapes(const SparseMlaDecodeParams& p, Device device, Outputs outputs) {
  constexpr std::string_view op = "sparse_mla_decode";
  expect_view(op, "q", p.q, {DType::kBF16}, {kAny, kAny, kAny, kQkDim}, {"B", "q_len", "H"}, device);
  const std::int64_t b = p.q.size(0), q_len = p.q.size(1), h = p.q.size(2);
  expect_decode_q_len(op, q_len);
  expect_range(op, "q.shape[2] (heads)", h, 1, kMaxHeads);
  expect_latent_cache(op, p.cache, device);
  expect_view(op, "indices", p.indices, {DType::kI32}, {b, q_len, kAny}, {"B", "q_len", "topk"}, device);
  expect_range(op, "indices.shape[2] (topk)", p.indices.size(2), 1, kMaxTopk);
  expect_view(op, "o", p.o, o_types(outputs), {b, q_len, h, kLatentDim}, {}, device);
  expect_view(op, "lse", p.lse, lse_types(outputs), {b, q_len, h}, {}, device);
  expect_scale(op, p.softmax_scale);
  expect_splits(op, p.num_splits);
  expect_apart(op, {span_of("o", p.o, true), span_of("lse", p.lse, true),
                    workspace_span(op, p.workspace, p.workspace_bytes), fault_span(p.fault),
                    span_of("q", p.q, false), span_of("cache.data", p.cache, false),
                    span_of("indices", p.indices, false)});
}

void validate_shapes(const SparseMlaPrefillParams& p, Device device, Outputs outputs) {
  constexpr std::string_view op = "sparse_mla_prefill";
  expect_view(op, "q", p.q, {DType::kBF16}, {kAny, kAny, kQkDim}, {"T", "H"}, device);
  const std::int64_t t = p.q.size(0), h = p.q.size(1);
  expect_range(op, "q.shape[1] (heads)", h, 1, kMaxHeads);
  expect_latent_cache(op, p.cache, device);
  expect_view(op, "indices", p.indices, {DType::kI32}, {t, kAny}, {"T", "topk"}, device);
  expect_range(op, "indices.shape[1] (topk)", p.indices.size(1), 1, kMaxTopk);
  expect_view(op, "o", p.o, o_types(outputs), {t, h, kLatentDim}, {}, device);
  expect_view(op, "lse", p.lse, lse_types(outputs), {t, h}, {}, device);
  expect_scale(op, p.softmax_scale);
  expect_splits(op, p.num_splits);
  expect_apart(op, {span_of("o", p.o, true), span_of("lse", p.lse, true),
                    workspace_span(op, p.workspace, p.workspace_bytes), fault_span(p.fault),
                    span_of("q", p.q, false), span_of("cache.data", p.cache, false),
                    span_of("indices", p.indices, false)});
}

void validate_shapes(const IndexerPrefillParams& p, Device device) {
  constexpr std::string_view op = "indexer_prefill";
  expect_view(op, "q", p.q, {DType::kFP8E4M3}, {kAny, kAny, kIndexerDim}, {"T", "Hi"}, device);
  const std::int64_t t = p.q.size(0), hi = p.q.size(1);
  expect_range(op, "q.shape[1] (indexer heads)", hi, 1, kMaxIndexerHeads);
  expect_view(op, "weights", p.weights, {DType::kF32}, {t, hi}, {}, device);
  expect_view(op, "cu_new_tokens", p.cu_new_tokens, {DType::kI32}, {kAny}, {"B + 1"}, device);
  const std::int64_t b = p.cu_new_tokens.size(0) - 1;
  if (b < 0) fail(op, "cu_new_tokens", describe(p.cu_new_tokens), "i32 [B + 1] with B >= 0");
  expect_indexer_cache(op, p.cache, device);
  expect_paging(op, p.block_table, p.seq_lens, b, device);
  expect_capacity(op, p.block_table, p.cache.page_size);
  expect_range(op, "k", p.k, 1, kMaxTopk, " (the DSA index_topk limit)");
  expect_view(op, "slots", p.slots, {DType::kI32}, {t, p.k}, {}, device);
  expect_chunk_tokens(op, p.chunk_tokens);
  expect_apart(op, {span_of("slots", p.slots, true), workspace_span(op, p.workspace, p.workspace_bytes),
                    fault_span(p.fault), span_of("q", p.q, false), span_of("weights", p.weights, false),
                    span_of("cu_new_tokens", p.cu_new_tokens, false),
                    span_of("cache.data", p.cache, false),
                    span_of("block_table", p.block_table, false), span_of("seq_lens", p.seq_lens, false)});
}

// ---------------------------------------------------------------------------------------------
// Values (host memory)

void validate_values(const AppendParams& p) {
  constexpr std::string_view op = "append";
  check_slots(op, "slots", p.slots, p.cache.num_slots());
  check_distinct_slots(op, "slots", p.slots);
  const bool pow2 = p.scale_mode == ScaleMode::kPow2;
  const bool fp8 = p.cache.dtype == KvDtype::kFp8E4M3;
  check_storable_bf16(op, "latent", p.latent, kQkDim, fp8 ? kLatentDim : 0, pow2);
  if (p.indexer.data != nullptr) check_storable_bf16(op, "indexer_keys", p.indexer_keys, kIndexerDim, kIndexerDim, pow2);
}

void validate_values(const MlaDecodeParams& p) {
  constexpr std::string_view op = "mla_decode";
  check_paging_values(op, p.block_table, p.seq_lens, p.cache.page_size, p.cache.num_pages);
  check_finite_bf16(op, "q", p.q);
}

void validate_values(const MlaPrefillParams& p) {
  constexpr std::string_view op = "mla_prefill";
  check_paging_values(op, p.block_table, p.seq_lens, p.cache.page_size, p.cache.num_pages);  // lengths first
  check_new_tokens(op, p.cu_new_tokens, p.seq_lens, p.q.size(0));
  check_finite_bf16(op, "q", p.q);
}

void validate_values(const IndexerLogitsParams& p) {
  constexpr std::string_view op = "indexer_logits";
  check_paging_values(op, p.block_table, p.seq_lens, p.cache.page_size, p.cache.num_pages);
  const auto* lens = p.seq_lens.as<const std::int32_t>();
  for (std::int64_t b = 0; b < p.seq_lens.size(0); ++b) {
    if (lens[b] > p.logits.size(2)) fail_seq_len_columns(op, b, lens[b], p.logits.size(2));
  }
  check_fp8_finite(op, "q", p.q);
  check_finite_f32(op, "weights", p.weights);
}

void validate_values(const TopkParams& p) {
  constexpr std::string_view op = "topk";
  check_paging_values(op, p.block_table, p.seq_lens, p.page_size, INT32_MAX / p.page_size);
  const std::int64_t q_len = p.logits.size(1), max_len = p.logits.size(2);
  const auto* lens = p.seq_lens.as<const std::int32_t>();
  const auto* logits = p.logits.as<const float>();
  for (std::int64_t b = 0; b < p.seq_lens.size(0); ++b) {
    if (lens[b] > max_len) fail_seq_len_columns(op, b, lens[b], max_len);
    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::int64_t visible = std::max<std::int64_t>(0, lens[b] - q_len + i + 1);
      for (std::int64_t t = 0; t < visible; ++t) {
        const float x = logits[(b * q_len + i) * max_len + t];
        if (std::isnan(x)) fail_nan_logit(op, b, i, t);
      }
    }
  }
}

void validate_values(const SparseMlaDecodeParams& p) {
  constexpr std::string_view op = "sparse_mla_decode";
  check_slots(op, "indices", p.indices, p.cache.num_slots());
  check_finite_bf16(op, "q", p.q);
}

void validate_values(const SparseMlaPrefillParams& p) {
  constexpr std::string_view op = "sparse_mla_prefill";
  check_slots(op, "indices", p.indices, p.cache.num_slots());
  check_finite_bf16(op, "q", p.q);
}

void validate_values(const IndexerPrefillParams& p) {
  constexpr std::string_view op = "indexer_prefill";
  check_paging_values(op, p.block_table, p.seq_lens, p.cache.page_size, p.cache.num_pages);  // lengths first
  check_new_tokens(op, p.cu_new_tokens, p.seq_lens, p.q.size(0));
  check_fp8_finite(op, "q", p.q);
  check_finite_f32(op, "weights", p.weights);
}

}  // namespace latentkv::detail
