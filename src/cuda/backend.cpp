// The CUDA backends:
//   cuda        - FP8-native kernels (append, dense and sparse MLA decode, indexer logits); also reads
//                 bf16 main caches.
//   cast_full   - what engines do today: cast the whole FP8 pool to bf16, then bf16 decode.
//   gather_cast - gather each request's tokens, cast them to a contiguous bf16 cache, then decode.
// Each backend's select() is the only place that decides both support and the kernel that runs.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "core/validate.hpp"
#include "cuda/common/cuda_check.hpp"
#include "cuda/indexer/launch.hpp"
#include "cuda/kv_cache/launch.hpp"
#include "cuda/mla/launch.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"

namespace latentkv {
namespace {

constexpr int kMinSm = 89;  // cvt.e4m3x2 and the 99 KB shared-memory plan

cudaStream_t stream_of(const ExecContext& c) { return static_cast<cudaStream_t>(c.stream); }

// Support common to every CUDA backend; an empty string means supported.
std::string device_problem(const Problem& p) {
  if (p.device.kind != DeviceKind::kCuda) return "needs a CUDA GPU (device is " + p.device.name + ")";
  if (p.device.sm < kMinSm) {
    return "needs sm_" + std::to_string(kMinSm) + " or newer (device is sm_" + std::to_string(p.device.sm) + ")";
  }
  if (p.heads > kMaxHeads) return "heads " + std::to_string(p.heads) + " outside 1 .. " + std::to_string(kMaxHeads);
  if (p.q_len > kMaxDecodeQLen) {
    return "q_len " + std::to_string(p.q_len) + " outside 1 .. " + std::to_string(kMaxDecodeQLen);
  }
  return {};
}

int rows_of(const Problem& p) { return (p.q_len > 0 ? p.q_len : 1) * (p.heads > 0 ? p.heads : 1); }

const MlaDecodeParams& decode_args(const OpArgs& args) { return std::get<MlaDecodeParams>(args); }

class CudaBackend final : public Backend {
 public:
  std::string_view name() const override { return "cuda"; }
  std::string_view description() const override {
    return "FP8-native CUDA kernels: the 656-byte pages are read once and dequantized on chip (bf16 caches too)";
  }
  int preference() const override { return 100; }

  Selection select(const Problem& p) const override {
    if (std::string why = device_problem(p); !why.empty()) return Selection::no(why);
    switch (p.op) {
      case Op::kAppend:
        return Selection::yes(Kernel{std::string("append<") + std::string(kv_dtype_name(p.kv_dtype)) + ">", run_append});
      case Op::kMlaDecode:
        return Selection::yes(Kernel{cuda::mla_decode_kernel_name(p.kv_dtype, rows_of(p)), run_decode},
                              "split-KV decode, any head count and page size");
      case Op::kIndexerLogits:
        if (p.heads > kMaxIndexerHeads) {
          return Selection::no("indexer heads " + std::to_string(p.heads) + " > " + std::to_string(kMaxIndexerHeads));
        }
        return Selection::yes(Kernel{"indexer_logits<fp8, cuda cores>", run_indexer_logits},
                              "one thread per cached token, float32 dot products of exact fp8 values");
      case Op::kSparseMlaDecode:
        if (p.topk > kMaxTopk) return Selection::no("topk " + std::to_string(p.topk) + " > " + std::to_string(kMaxTopk));
        return Selection::yes(
            Kernel{cuda::mla_decode_kernel_name(p.kv_dtype, p.heads > 0 ? p.heads : 1, true), run_sparse_decode},
            "each query token over its own index row, the selected fp8 tokens read once and dequantized on chip");
      default:
        return Selection::no(std::string(op_name(p.op)) + " has no CUDA kernel yet");
    }
  }

  Plan plan(const OpArgs& args, const DeviceInfo& device) const override {
    if (op_of(args) == Op::kMlaDecode) return cuda::plan_mla_decode(decode_args(args), device.multiprocessors);
    if (op_of(args) == Op::kSparseMlaDecode) {
      return cuda::plan_sparse_mla_decode(std::get<SparseMlaDecodeParams>(args), device.multiprocessors);
    }
    return {};
  }

 private:
  static void run_append(const OpArgs& args, const ExecContext& c) {
    const auto& p = std::get<AppendParams>(args);
    detail::validate_shapes(p, Device::cuda());
    cuda::launch_append(p, stream_of(c));
  }
  static void run_decode(const OpArgs& args, const ExecContext& c) {
    const auto& p = decode_args(args);
    detail::validate_shapes(p, Device::cuda(), detail::Outputs::kDeviceTypes);
    cuda::launch_mla_decode(p, stream_of(c));
  }
  static void run_indexer_logits(const OpArgs& args, const ExecContext& c) {
    const auto& p = std::get<IndexerLogitsParams>(args);
    detail::validate_shapes(p, Device::cuda());
    cuda::launch_indexer_logits(p, stream_of(c));
  }
  static void run_sparse_decode(const OpArgs& args, const ExecContext& c) {
    const auto& p = std::get<SparseMlaDecodeParams>(args);
    detail::validate_shapes(p, Device::cuda(), detail::Outputs::kDeviceTypes);
    cuda::launch_sparse_mla_decode(p, stream_of(c));
  }
};

// The two cast baselines share their shape: scratch = [bf16 copy][decode workspace].
class CastBaseline : public Backend {
 public:
  int preference() const override { return 1; }  // never preferred over FP8-native kernels

  Selection select(const Problem& p) const override {
    if (std::string why = device_problem(p); !why.empty()) return Selection::no(why);
    if (p.op != Op::kMlaDecode) return Selection::no("baseline for mla_decode only");
    if (p.kv_dtype != KvDtype::kFp8E4M3) return Selection::no("casts an fp8_e4m3 cache; the cache is bf16");
    const Backend* self = this;
    return Selection::yes(Kernel{std::string(name()) + " + " + cuda::mla_decode_kernel_name(KvDtype::kBf16, rows_of(p)),
                                 [self](const OpArgs& args, const ExecContext& c) {
                                   static_cast<const CastBaseline*>(self)->run(decode_args(args), stream_of(c));
                                 }},
                          "baseline: " + std::string(extra_traffic()));
  }

  Plan plan(const OpArgs& args, const DeviceInfo& device) const override {
    const MlaDecodeParams inner = bf16_params(decode_args(args), nullptr);
    Plan plan = cuda::plan_mla_decode(inner, device.multiprocessors);
    plan.workspace_bytes += copy_bytes(decode_args(args));
    return plan;
  }

 protected:
  // Bytes of the bf16 copy (and any table) at the start of the workspace.
  virtual std::size_t copy_bytes(const MlaDecodeParams& p) const = 0;
  // Fills the bf16 copy at `scratch` and returns decode parameters that read it.
  virtual MlaDecodeParams prepare(const MlaDecodeParams& p, std::uint8_t* scratch, cudaStream_t s) const = 0;
  virtual MlaDecodeParams bf16_params(const MlaDecodeParams& p, std::uint8_t* scratch) const = 0;

 private:
  void run(const MlaDecodeParams& p, cudaStream_t s) const {
    detail::validate_shapes(p, Device::cuda(), detail::Outputs::kDeviceTypes);
    const std::size_t copy = copy_bytes(p);
    if (p.workspace == nullptr || p.workspace_bytes < copy) {
      throw Error("mla_decode", "workspace_bytes", std::to_string(p.workspace_bytes),
                  ">= " + std::to_string(copy) + " for the " + std::string(name()) + " bf16 copy (see plan())");
    }
    MlaDecodeParams inner = prepare(p, static_cast<std::uint8_t*>(p.workspace), s);
    inner.workspace = static_cast<std::uint8_t*>(p.workspace) + copy;
    inner.workspace_bytes = p.workspace_bytes - copy;
    cuda::launch_mla_decode(inner, s);
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
  std::size_t copy_bytes(const MlaDecodeParams& p) const override {
    return static_cast<std::size_t>(p.cache.num_slots()) * kBf16TokenBytes;
  }
  MlaDecodeParams bf16_params(const MlaDecodeParams& p, std::uint8_t* scratch) const override {
    MlaDecodeParams inner = p;
    inner.cache.data = scratch;
    inner.cache.dtype = KvDtype::kBf16;
    return inner;
  }
  MlaDecodeParams prepare(const MlaDecodeParams& p, std::uint8_t* scratch, cudaStream_t s) const override {
    cuda::launch_cast_pool(p.cache, scratch, s);
    return bf16_params(p, scratch);
  }
};

class GatherCastBackend final : public CastBaseline {
 public:
  std::string_view name() const override { return "gather_cast"; }
  std::string_view description() const override {
    return "baseline: gather each request's FP8 tokens, cast them to a contiguous bf16 cache, then bf16 decode";
  }
  std::string_view extra_traffic() const override {
    return "writes 1152 B and reads it back for every visible token, every call";
  }

 protected:
  static std::size_t capacity(const MlaDecodeParams& p) {
    return static_cast<std::size_t>(p.block_table.size(1)) * static_cast<std::size_t>(p.cache.page_size);
  }
  static std::size_t table_offset(const MlaDecodeParams& p) {
    return static_cast<std::size_t>(p.q.size(0)) * capacity(p) * kBf16TokenBytes;
  }
  std::size_t copy_bytes(const MlaDecodeParams& p) const override {
    const std::size_t table = sizeof(std::int32_t) * static_cast<std::size_t>(p.block_table.numel());
    return (table_offset(p) + table + 255) / 256 * 256;
  }
  MlaDecodeParams bf16_params(const MlaDecodeParams& p, std::uint8_t* scratch) const override {
    MlaDecodeParams inner = p;
    inner.cache.data = scratch;
    inner.cache.dtype = KvDtype::kBf16;
    inner.cache.num_pages = p.q.size(0) * p.block_table.size(1);
    inner.block_table.data = scratch ? scratch + table_offset(p) : nullptr;
    return inner;
  }
  MlaDecodeParams prepare(const MlaDecodeParams& p, std::uint8_t* scratch, cudaStream_t s) const override {
    MlaDecodeParams inner = bf16_params(p, scratch);
    cuda::launch_gather_cast(p.cache, p.block_table.as<const std::int32_t>(), p.seq_lens.as<const std::int32_t>(),
                             static_cast<int>(p.q.size(0)), static_cast<int>(p.block_table.size(1)), scratch,
                             inner.block_table.as<std::int32_t>(), s);
    return inner;
  }
};

}  // namespace

std::unique_ptr<Backend> make_backend_cuda() { return std::make_unique<CudaBackend>(); }
std::unique_ptr<Backend> make_backend_cast_full() { return std::make_unique<CastFullBackend>(); }
std::unique_ptr<Backend> make_backend_gather_cast() { return std::make_unique<GatherCastBackend>(); }

}  // namespace latentkv
