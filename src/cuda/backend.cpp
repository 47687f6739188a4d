// The CUDA backend `cuda`: FP8-native kernels (append, dense and sparse MLA decode and prefill,
// indexer logits and prefill, top-k); also reads bf16 main caches. The cast baselines live in baselines/.
// select() is the only place that decides both support and the kernel that runs.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "core/validate.hpp"
#include "cuda/common/backend_support.hpp"
#include "cuda/common/cuda_check.hpp"
#include "cuda/indexer/launch.hpp"
#include "cuda/kv_cache/launch.hpp"
#include "cuda/mla/launch.hpp"
#include "cuda/topk/launch.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"

namespace latentkv {
namespace {

using cuda::device_problem;
using cuda::rows_of;
using cuda::stream_of;

const MlaDecodeParams& decode_args(const OpArgs& args) { return std::get<MlaDecodeParams>(args); }

// An op's kernel, which refuses other ops' parameters (make_kernel). Both its check (Kernel::check)
// and its launch run the shape checks every backend makes (validate.hpp); then the check runs
// `check_call`, what the launcher refuses before it queues anything, and the launch runs `launch`,
// the launcher, which calls check_call itself first.
template <typename Params, typename CheckCall, typename Launch>
Kernel op_kernel(std::string name, CheckCall check_call, Launch launch) {
  const auto shapes = [](const OpArgs& args) {
    const auto& p = std::get<Params>(args);
    const Device device = cuda::launch_device(std::string(op_name(op_of(args))).c_str());
    if constexpr (requires { detail::validate_shapes(p, device, detail::Outputs::kDeviceTypes); }) {
      detail::validate_shapes(p, device, detail::Outputs::kDeviceTypes);
    } else {
      detail::validate_shapes(p, device);
    }
  };
  return make_kernel(
      op_of(OpArgs(std::in_place_type<Params>)), std::move(name),
      [shapes, launch](const OpArgs& args, const ExecContext& c) {
        shapes(args);
        launch(std::get<Params>(args), stream_of(c));
      },
      [shapes, check_call](const OpArgs& args) {
        shapes(args);
        check_call(std::get<Params>(args));
      });
}

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
        return Selection::yes(op_kernel<AppendParams>("append<" + std::string(kv_dtype_name(p.kv_dtype)) + ">",
                                                      cuda::check_append_call, cuda::launch_append));
      case Op::kMlaDecode:
        return Selection::yes(
            op_kernel<MlaDecodeParams>(cuda::mla_decode_kernel_name(p.kv_dtype, rows_of(p), p.device.sm),
                                       [](const MlaDecodeParams& q) { cuda::check_mla_decode_call(q); },
                                       [](const MlaDecodeParams& q, cudaStream_t s) { cuda::launch_mla_decode(q, s); }),
            "split-KV decode, any head count and page size");
      case Op::kIndexerLogits:
        if (p.heads > kMaxIndexerHeads) {
          return Selection::no("indexer heads " + std::to_string(p.heads) + " > " + std::to_string(kMaxIndexerHeads));
        }
        return Selection::yes(
            op_kernel<IndexerLogitsParams>(cuda::indexer_logits_kernel_name(p.page_size, p.device.sm),
                                           cuda::check_indexer_logits_call, cuda::launch_indexer_logits),
            "tensor cores over the fp8 keys converted exactly to f16 on chip, float32 sums");
      case Op::kTopk:
        if (p.topk > kMaxTopk) return Selection::no("k " + std::to_string(p.topk) + " > " + std::to_string(kMaxTopk));
        return Selection::yes(
            op_kernel<TopkParams>("topk<radix select, 12+10+10 bits>", cuda::check_topk_call, cuda::launch_topk),
            "exact radix select over the float bits; rows seeing <= k tokens take them all");
      case Op::kMlaPrefill:
        return Selection::yes(
            op_kernel<MlaPrefillParams>(
                cuda::mla_prefill_kernel_name(p.kv_dtype, p.heads > 0 ? p.heads : 1, p.device.sm),
                cuda::check_mla_prefill_call, cuda::launch_mla_prefill),
            "the new tokens (in groups on few heads) as query rows of the decode kernels over "
            "their visible prefix");
      case Op::kSparseMlaPrefill:
        if (p.topk > kMaxTopk) return Selection::no("topk " + std::to_string(p.topk) + " > " + std::to_string(kMaxTopk));
        return Selection::yes(
            op_kernel<SparseMlaPrefillParams>(
                "sparse_mla_prefill = per-token " +
                    cuda::mla_decode_kernel_name(p.kv_dtype, p.heads > 0 ? p.heads : 1, p.device.sm, true),
                cuda::check_sparse_mla_prefill_call, cuda::launch_sparse_mla_prefill),
            "each new token over its own index row, the selected fp8 tokens read once and dequantized on chip");
      case Op::kIndexerPrefill:
        if (p.heads > kMaxIndexerHeads) {
          return Selection::no("indexer heads " + std::to_string(p.heads) + " > " + std::to_string(kMaxIndexerHeads));
        }
        if (p.topk > kMaxTopk) return Selection::no("k " + std::to_string(p.topk) + " > " + std::to_string(kMaxTopk));
        return Selection::yes(
            op_kernel<IndexerPrefillParams>(cuda::indexer_prefill_kernel_name(p.page_size, p.device.sm),
                                            cuda::check_indexer_prefill_call, cuda::launch_indexer_prefill),
            "the new tokens (in groups of 4 on the wgmma indexer) as requests of the decode indexer, "
            "then each its own top-k row, in chunks of new tokens whose logits fit the workspace");
      case Op::kSparseMlaDecode:
        if (p.topk > kMaxTopk) return Selection::no("topk " + std::to_string(p.topk) + " > " + std::to_string(kMaxTopk));
        return Selection::yes(
            op_kernel<SparseMlaDecodeParams>(
                cuda::mla_decode_kernel_name(p.kv_dtype, p.heads > 0 ? p.heads : 1, p.device.sm, true),
                [](const SparseMlaDecodeParams& q) { cuda::check_sparse_mla_decode_call(q); },
                [](const SparseMlaDecodeParams& q, cudaStream_t s) { cuda::launch_sparse_mla_decode(q, s); }),
            "each query token over its own index row, the selected fp8 tokens read once and dequantized on chip");
      default:
        return Selection::no(std::string(op_name(p.op)) + " has no CUDA kernel yet");
    }
  }

  Plan plan(const OpArgs& args, const DeviceInfo& device) const override {
    cuda::check_plan_extents(args, device);
    // The planners read the current device's limits and occupancy: those of `device`, for a plan made
    // while another GPU of the process is current.
    const cuda::ScopedCurrentDevice on(device, std::string(op_name(op_of(args))).c_str());
    if (op_of(args) == Op::kMlaDecode) return cuda::plan_mla_decode(decode_args(args), device.multiprocessors);
    if (op_of(args) == Op::kSparseMlaDecode) {
      return cuda::plan_sparse_mla_decode(std::get<SparseMlaDecodeParams>(args), device.multiprocessors);
    }
    if (op_of(args) == Op::kTopk) return cuda::plan_topk(std::get<TopkParams>(args));
    if (op_of(args) == Op::kIndexerLogits) return cuda::plan_indexer_logits(std::get<IndexerLogitsParams>(args));
    if (op_of(args) == Op::kMlaPrefill) {
      return cuda::plan_mla_prefill(std::get<MlaPrefillParams>(args), device.multiprocessors);
    }
    if (op_of(args) == Op::kIndexerPrefill) return cuda::plan_indexer_prefill(std::get<IndexerPrefillParams>(args));
    if (op_of(args) == Op::kSparseMlaPrefill) {
      return cuda::plan_sparse_mla_prefill(std::get<SparseMlaPrefillParams>(args), device.multiprocessors);
    }
    return {};
  }

};

}  // namespace

std::unique_ptr<Backend> make_backend_cuda() { return std::make_unique<CudaBackend>(); }

}  // namespace latentkv
