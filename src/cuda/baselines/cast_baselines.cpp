// The cast baselines, registered as backends for honest side-by-side figures, for dense and sparse
// MLA decode (and sparse prefill, as sparse decode of one-token requests) over an fp8 cache:
//   cast_full   - what engines do today: cast the whole FP8 pool to bf16, then the bf16 decode.
//   gather_cast - dense: gather each request's tokens; sparse: gather each query row's selected
//                 slots; cast them into a contiguous bf16 cache, then the bf16 decode over it.
// Both are never preferred by `auto`; bench and step name them explicitly. The scratch of a call is
// [bf16 copy (and its table or indices)][the bf16 decode's own workspace].
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <variant>

#include "core/validate.hpp"
#include "cuda/common/backend_support.hpp"
#include "cuda/common/cuda_check.hpp"
#include "cuda/kv_cache/launch.hpp"
#include "cuda/mla/launch.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"

namespace latentkv {
namespace {

using cuda::device_problem;
using cuda::rows_of;
using cuda::stream_of;

// Byte counts of a bf16 copy, in a type no shape can make wrap: every factor is at most 2^64 - 1 and
// every product of counts is held to that too (capped_product), so a count times a token's 1152
// bytes, plus an alignment, stays below 2^76.
__extension__ typedef unsigned __int128 Bytes;  // (a GCC and Clang extension)
constexpr Bytes kMostCount = std::numeric_limits<std::uint64_t>::max();
Bytes count_of(std::int64_t n) { return static_cast<Bytes>(std::max<std::int64_t>(n, 0)); }
Bytes capped_product(Bytes a, Bytes b) {
  return std::min(std::min(a, kMostCount) * std::min(b, kMostCount), kMostCount);
}
Bytes align256(Bytes n) { return (n + 255) / 256 * 256; }

class CastBaseline : public Backend {
 public:
  int preference() const override { return 1; }  // never preferred over FP8-native kernels

  // What the baseline is for comes before the device: on a machine without a GPU a slot it can never
  // serve says so, instead of "needs a CUDA GPU", which a GPU would not fix.
  Selection select(const Problem& p) const override {
    if (p.op != Op::kMlaDecode && p.op != Op::kSparseMlaDecode && p.op != Op::kSparseMlaPrefill) {
      return Selection::no("baseline for mla_decode, sparse_mla_decode and sparse_mla_prefill only");
    }
    if (p.kv_dtype != KvDtype::kFp8E4M3) return Selection::no("casts an fp8_e4m3 cache; the cache is bf16");
    if (std::string why = device_problem(p); !why.empty()) return Selection::no(why);
    const bool sparse = p.op != Op::kMlaDecode;
    if (sparse && p.topk > kMaxTopk) {
      return Selection::no("topk " + std::to_string(p.topk) + " > " + std::to_string(kMaxTopk));
    }
    const Backend* self = this;
    const std::string inner =
        cuda::mla_decode_kernel_name(KvDtype::kBf16, sparse ? std::max(p.heads, 1) : rows_of(p), p.device.sm, sparse);
    return Selection::yes(make_kernel(
                              p.op, std::string(name()) + " + " + inner,
                              [self](const OpArgs& args, const ExecContext& c) {
                                static_cast<const CastBaseline*>(self)->run(args, stream_of(c));
                              },
                              [self](const OpArgs& args) { static_cast<const CastBaseline*>(self)->check(args); }),
                          "baseline: " + std::string(extra_traffic()));
  }

  Plan plan(const OpArgs& args, const DeviceInfo& device) const override {
    // As the cuda backend's plan(): the shapes counted with checked first, and the planners read the
    // current device, made `device` here. The copy is sized before that: a copy too large for a
    // 64-bit byte count is refused here, not planned as a wrapped size that the call would refuse.
    cuda::check_plan_extents(args, device);
    const char* op = std::holds_alternative<MlaDecodeParams>(args)          ? "mla_decode"
                     : std::holds_alternative<SparseMlaPrefillParams>(args) ? "sparse_mla_prefill"
                                                                            : "sparse_mla_decode";
    const auto planned = [&](const auto& params, const auto& plan_decode) {
      (void)checked_copy_bytes(params, op);
      const cuda::ScopedCurrentDevice on(device, op);
      Plan plan = plan_decode(cast(params, nullptr, nullptr));
      plan.workspace_bytes += checked_copy_bytes(params, op, plan.workspace_bytes);
      return plan;
    };
    if (const auto* dense = std::get_if<MlaDecodeParams>(&args)) {
      return planned(*dense,
                     [&](const MlaDecodeParams& q) { return cuda::plan_mla_decode(q, device.multiprocessors); });
    }
    return planned(sparse_of(args), [&](const SparseMlaDecodeParams& q) {
      return cuda::plan_sparse_mla_decode(q, device.multiprocessors, op);
    });
  }

 protected:
  // Bytes of the bf16 copy (and its table or indices) at the start of the workspace, and the argument
  // its size comes from (named when it is too large to count).
  struct CopySize {
    Bytes bytes;
    const char* argument;
    std::string value;
  };
  virtual CopySize copy_bytes(const MlaDecodeParams& p) const = 0;
  virtual CopySize copy_bytes(const SparseMlaDecodeParams& p) const = 0;
  // The decode parameters that read the bf16 copy at `scratch`; with a stream (and scratch), the
  // cast that fills it is queued on it first (without one, only the parameters are computed, for
  // planning and checks).
  virtual MlaDecodeParams cast(const MlaDecodeParams& p, std::uint8_t* scratch, const cudaStream_t* s) const = 0;
  virtual SparseMlaDecodeParams cast(const SparseMlaDecodeParams& p, std::uint8_t* scratch,
                                     const cudaStream_t* s) const = 0;

 private:
  // copy_bytes(p) as a byte count, or an Error naming `op` and the argument the copy's size comes from
  // when it, with `beside` bytes of the decode's own scratch after it, has no 64-bit size.
  template <typename Params>
  std::size_t checked_copy_bytes(const Params& p, std::string_view op, std::size_t beside = 0) const {
    const CopySize copy = copy_bytes(p);
    if (copy.bytes + beside > std::numeric_limits<std::size_t>::max()) {
      throw Error(std::string(op), copy.argument, copy.value,
                  "a bf16 copy (1152 B a token)" +
                      (beside > 0 ? " that with the decode's " + std::to_string(beside) + " bytes of scratch has"
                                  : std::string(" of")) +
                      " fewer than 2^64 bytes, for the " + std::string(name()) + " baseline");
    }
    return static_cast<std::size_t>(copy.bytes);
  }

  // The inner decode's parameters, after the checks of the call; with a stream, the cast queued.
  template <typename Params>
  Params with_copy(const Params& p, std::string_view op, const cudaStream_t* s) const {
    const std::string op_name(op);
    detail::validate_shapes(p, cuda::launch_device(op_name.c_str()), detail::Outputs::kDeviceTypes);
    // What the cast reads, checked here: the inner decode's checks see only the bf16 copy. (A kernel
    // kept from an fp8 selection may be handed a bf16 cache.)
    if (p.cache.dtype != KvDtype::kFp8E4M3) {
      throw Error(op_name, "cache.dtype", std::string(kv_dtype_name(p.cache.dtype)),
                  "fp8_e4m3: the " + std::string(name()) + " baseline casts an fp8 cache");
    }
    cuda::check_aligned(op_name.c_str(), "cache.data", p.cache.data, 16);  // read as 16-byte pieces
    // The decode's own limit (a grid dimension), checked before the cast is queued: these baselines
    // do not slice a call as the cuda backend's prefill does.
    constexpr bool kSparse = std::is_same_v<Params, SparseMlaDecodeParams>;
    const std::int64_t queries = p.q.size(0) * (kSparse ? p.q.size(1) : 1);
    if (queries > cuda::kMaxDecodeBatch) {
      throw Error(op_name, "q", std::to_string(queries) + (kSparse ? " query tokens" : " requests"),
                  "at most " + std::to_string(cuda::kMaxDecodeBatch) + " per call on the " + std::string(name()) +
                      " baseline");
    }
    const std::size_t copy = checked_copy_bytes(p, op);  // 0 for gather_cast over no requests or no index entries
    if (copy > 0) {
      const std::string what = " for the " + std::string(name()) + " bf16 copy (see plan())";
      if (p.workspace == nullptr) throw Error(op_name, "workspace", "null", std::to_string(copy) + " bytes" + what);
      if (p.workspace_bytes < copy) {
        throw Error(op_name, "workspace_bytes", std::to_string(p.workspace_bytes), ">= " + std::to_string(copy) + what);
      }
      cuda::check_aligned(op_name.c_str(), "workspace", p.workspace, 16);  // the copy: 16-byte pieces
    }
    auto* scratch = static_cast<std::uint8_t*>(p.workspace);
    Params inner = cast(p, copy > 0 ? scratch : nullptr, s);  // nothing to cast: no launch
    inner.workspace = scratch + copy;
    inner.workspace_bytes = p.workspace_bytes - copy;
    inner.fault = nullptr;  // yardsticks: like the engines they stand for, they skip bad entries unnoted
    return inner;
  }

  // Kernel::check: the call's checks and the inner decode's, the cast not queued.
  void check(const OpArgs& args) const {
    if (const auto* dense = std::get_if<MlaDecodeParams>(&args)) {
      cuda::check_mla_decode_call(with_copy(*dense, "mla_decode", nullptr));
    } else {
      const char* op = sparse_op(args);
      cuda::check_sparse_mla_decode_call(with_copy(sparse_of(args), op, nullptr), op);
    }
  }

  // The checks first, so that nothing is queued for a call the inner decode would refuse.
  void run(const OpArgs& args, cudaStream_t s) const {
    check(args);
    if (const auto* dense = std::get_if<MlaDecodeParams>(&args)) {
      cuda::launch_mla_decode(with_copy(*dense, "mla_decode", &s), s);
    } else {
      const char* op = sparse_op(args);
      cuda::launch_sparse_mla_decode(with_copy(sparse_of(args), op, &s), s, {op});
    }
  }

  // A sparse call's op, its prefill's shapes checked first (sparse_of reshapes them).
  static const char* sparse_op(const OpArgs& args) {
    const auto* prefill = std::get_if<SparseMlaPrefillParams>(&args);
    if (prefill == nullptr) return "sparse_mla_decode";
    detail::validate_shapes(*prefill, cuda::launch_device("sparse_mla_prefill"), detail::Outputs::kDeviceTypes);
    return "sparse_mla_prefill";
  }

  // Sparse prefill is sparse decode of T one-token requests; the baselines treat it so.
  static SparseMlaDecodeParams sparse_of(const OpArgs& args) {
    if (const auto* prefill = std::get_if<SparseMlaPrefillParams>(&args)) return cuda::as_sparse_decode(*prefill);
    return std::get<SparseMlaDecodeParams>(args);
  }
};

class CastFullBackend final : public CastBaseline {
 public:
  std::string_view name() const override { return "cast_full"; }
  std::string_view description() const override {
    return "baseline: cast the whole FP8 pool to bf16 every call, then bf16 decode (what engines do today)";
  }
  std::string_view extra_traffic() const override {
    return "reads 656 B and writes 1152 B for every slot of the pool, every call";
  }

 protected:
  static CopySize pool_bytes(const LatentCache& c) {
    return {align256(count_of(c.num_slots()) * kBf16TokenBytes), "cache",
            std::to_string(c.num_pages) + " pages of " + std::to_string(c.page_size) + " slots"};
  }
  CopySize copy_bytes(const MlaDecodeParams& p) const override { return pool_bytes(p.cache); }
  CopySize copy_bytes(const SparseMlaDecodeParams& p) const override { return pool_bytes(p.cache); }

  static LatentCache cast_pool(const LatentCache& fp8, std::uint8_t* scratch, const cudaStream_t* s) {
    if (scratch != nullptr && s != nullptr) cuda::launch_cast_pool(fp8, scratch, *s);
    LatentCache bf16 = fp8;
    bf16.data = scratch;
    bf16.dtype = KvDtype::kBf16;
    return bf16;
  }
  MlaDecodeParams cast(const MlaDecodeParams& p, std::uint8_t* scratch, const cudaStream_t* s) const override {
    MlaDecodeParams inner = p;
    inner.cache = cast_pool(p.cache, scratch, s);
    return inner;
  }
  SparseMlaDecodeParams cast(const SparseMlaDecodeParams& p, std::uint8_t* scratch,
                             const cudaStream_t* s) const override {
    SparseMlaDecodeParams inner = p;
    inner.cache = cast_pool(p.cache, scratch, s);
    return inner;
  }
};

class GatherCastBackend final : public CastBaseline {
 public:
  std::string_view name() const override { return "gather_cast"; }
  std::string_view description() const override {
    return "baseline: gather the FP8 tokens a call reads (a request's, or a row's selected slots), cast them to a "
           "contiguous bf16 cache, then bf16 decode";
  }
  std::string_view extra_traffic() const override {
    return "writes 1152 B and reads it back for every token read, every call";
  }

 protected:
  // Dense: [batch, capacity] bf16 tokens, then an identity block table.
  // Tokens of the copy: batch x the block table's capacity (capped: the block table's columns are
  // bounded only by its bytes here).
  static Bytes copy_tokens(const MlaDecodeParams& p) {
    return capped_product(capped_product(count_of(p.q.size(0)), count_of(p.block_table.size(1))),
                          count_of(p.cache.page_size));
  }
  // Where the identity block table starts (within the copy, whose size checked_copy_bytes bounds).
  static std::size_t table_offset(const MlaDecodeParams& p) {
    return static_cast<std::size_t>(copy_tokens(p) * kBf16TokenBytes);
  }
  CopySize copy_bytes(const MlaDecodeParams& p) const override {
    return {align256(copy_tokens(p) * kBf16TokenBytes + sizeof(std::int32_t) * count_of(p.block_table.numel())),
            "block_table",
            std::to_string(p.q.size(0)) + " requests of " + std::to_string(p.block_table.size(1)) + " pages of " +
                std::to_string(p.cache.page_size) + " tokens"};
  }
  MlaDecodeParams cast(const MlaDecodeParams& p, std::uint8_t* scratch, const cudaStream_t* s) const override {
    MlaDecodeParams inner = p;
    inner.cache.data = scratch;
    inner.cache.dtype = KvDtype::kBf16;
    inner.cache.num_pages = p.q.size(0) * p.block_table.size(1);
    inner.block_table.data = scratch ? scratch + table_offset(p) : nullptr;
    if (scratch != nullptr && s != nullptr) {
      cuda::launch_gather_cast(p.cache, p.block_table.as<const std::int32_t>(), p.seq_lens.as<const std::int32_t>(),
                               static_cast<int>(p.q.size(0)), static_cast<int>(p.block_table.size(1)), scratch,
                               inner.block_table.as<std::int32_t>(), *s);
    }
    return inner;
  }

  // Sparse: one bf16 token per index entry [B * q_len * topk], then the remapped indices.
  static Bytes indices_offset(const SparseMlaDecodeParams& p) {
    return align256(count_of(p.indices.numel()) * kBf16TokenBytes);
  }
  CopySize copy_bytes(const SparseMlaDecodeParams& p) const override {
    return {align256(indices_offset(p) + sizeof(std::int32_t) * count_of(p.indices.numel())), "indices",
            std::to_string(p.indices.numel()) + " entries"};
  }
  SparseMlaDecodeParams cast(const SparseMlaDecodeParams& p, std::uint8_t* scratch,
                             const cudaStream_t* s) const override {
    SparseMlaDecodeParams inner = p;
    inner.cache.data = scratch;
    inner.cache.dtype = KvDtype::kBf16;
    inner.cache.page_size = 1;
    inner.cache.num_pages = std::max<std::int64_t>(p.indices.numel(), 1);
    inner.indices.data = scratch ? scratch + static_cast<std::size_t>(indices_offset(p)) : nullptr;
    if (scratch != nullptr && s != nullptr) {
      cuda::launch_gather_cast_indices(p.cache, p.indices.as<const std::int32_t>(), p.indices.numel(), scratch,
                                       inner.indices.as<std::int32_t>(), *s);
    }
    return inner;
  }
};

}  // namespace

std::unique_ptr<Backend> make_backend_cast_full() { return std::make_unique<CastFullBackend>(); }
std::unique_ptr<Backend> make_backend_gather_cast() { return std::make_unique<GatherCastBackend>(); }

}  // namespace latentkv
