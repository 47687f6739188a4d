#include "latentkv/backend.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <variant>

#include "core/selection.hpp"
#include "core/validate.hpp"
#include "latentkv/error.hpp"

namespace latentkv {
namespace detail {
std::vector<std::unique_ptr<Backend>> make_registered_backends();  // backends_generated.cpp
#ifdef LKV_WITH_CUDA
bool cuda_detect_device(DeviceInfo& info);  // src/cuda/common/device.cpp
#endif
}  // namespace detail

std::string_view op_name(Op op) {
  switch (op) {
    case Op::kAppend: return "append";
    case Op::kMlaDecode: return "mla_decode";
    case Op::kMlaPrefill: return "mla_prefill";
    case Op::kIndexerLogits: return "indexer_logits";
    case Op::kTopk: return "topk";
    case Op::kSparseMlaDecode: return "sparse_mla_decode";
    case Op::kSparseMlaPrefill: return "sparse_mla_prefill";
    case Op::kIndexerPrefill: return "indexer_prefill";
  }
  return "?";
}

DeviceInfo detect_device() {
  DeviceInfo info;
#ifdef LKV_WITH_CUDA
  if (detail::cuda_detect_device(info)) return info;
#endif
  return info;
}

DeviceInfo device_info_for(Device where) { return where.kind == DeviceKind::kCpu ? DeviceInfo{} : detect_device(); }

namespace {

// The view whose memory decides where a call that names no device runs: its name and its device.
struct Anchor {
  const char* name;
  Device device;
};
Anchor anchor_of(const OpArgs& args) {
  return std::visit(
      [](const auto& a) {
        if constexpr (std::is_same_v<std::decay_t<decltype(a)>, TopkParams>) return Anchor{"logits.device", a.logits.device};
        else return Anchor{"cache.device", a.cache.device};
      },
      args);
}

}  // namespace

DeviceInfo device_of(const OpArgs& args) { return device_info_for(anchor_of(args).device); }

Op op_of(const OpArgs& args) {
  struct Visitor {
    Op operator()(const AppendParams&) const { return Op::kAppend; }
    Op operator()(const MlaDecodeParams&) const { return Op::kMlaDecode; }
    Op operator()(const MlaPrefillParams&) const { return Op::kMlaPrefill; }
    Op operator()(const IndexerLogitsParams&) const { return Op::kIndexerLogits; }
    Op operator()(const TopkParams&) const { return Op::kTopk; }
    Op operator()(const SparseMlaDecodeParams&) const { return Op::kSparseMlaDecode; }
    Op operator()(const SparseMlaPrefillParams&) const { return Op::kSparseMlaPrefill; }
    Op operator()(const IndexerPrefillParams&) const { return Op::kIndexerPrefill; }
  };
  return std::visit(Visitor{}, args);
}

namespace {

// An extent of a caller's view as the selection sees it (an int): one outside int32 is refused here,
// naming the view, rather than read truncated (heads 2^32 + 200 as 200); validation sees the rest.
int extent_of(Op op, const char* argument, const TensorView& v, int dim) {
  const std::int64_t e = v.size(dim);
  if (e < 0 || e > INT32_MAX) throw Error(std::string(op_name(op)), argument, v.shape_string(), "extents 0 .. 2^31-1");
  return static_cast<int>(e);
}

}  // namespace

Problem problem_of(const OpArgs& args, const DeviceInfo& device) {
  Problem p;
  p.op = op_of(args);
  p.device = device;
  struct Visitor {
    Problem& p;
    int q(const TensorView& v, int dim) const { return extent_of(p.op, "q", v, dim); }
    void operator()(const AppendParams& a) const {
      p.kv_dtype = a.cache.dtype;
      p.page_size = a.cache.page_size;
    }
    void operator()(const MlaDecodeParams& a) const {
      p.kv_dtype = a.cache.dtype;
      p.page_size = a.cache.page_size;
      p.heads = q(a.q, 2);
      p.q_len = q(a.q, 1);
    }
    void operator()(const MlaPrefillParams& a) const {
      p.kv_dtype = a.cache.dtype;
      p.page_size = a.cache.page_size;
      p.heads = q(a.q, 1);
    }
    void operator()(const IndexerLogitsParams& a) const {
      p.page_size = a.cache.page_size;
      p.heads = q(a.q, 2);
      p.q_len = q(a.q, 1);
    }
    void operator()(const TopkParams& a) const {
      p.page_size = a.page_size;
      p.q_len = extent_of(p.op, "logits", a.logits, 1);
      p.topk = a.k;
    }
    void operator()(const SparseMlaDecodeParams& a) const {
      p.kv_dtype = a.cache.dtype;
      p.page_size = a.cache.page_size;
      p.heads = q(a.q, 2);
      p.q_len = q(a.q, 1);
      p.topk = extent_of(p.op, "indices", a.indices, 2);
    }
    void operator()(const SparseMlaPrefillParams& a) const {
      p.kv_dtype = a.cache.dtype;
      p.page_size = a.cache.page_size;
      p.heads = q(a.q, 1);
      p.topk = extent_of(p.op, "indices", a.indices, 1);
    }
    void operator()(const IndexerPrefillParams& a) const {
      p.page_size = a.cache.page_size;
      p.heads = q(a.q, 1);
      p.topk = a.k;
    }
  };
  std::visit(Visitor{p}, args);
  return p;
}

Kernel make_kernel(Op op, std::string name, std::function<void(const OpArgs&, const ExecContext&)> launch,
                   std::function<void(const OpArgs&)> check) {
  const auto same_op = [op, name](const OpArgs& args) {
    if (op_of(args) != op) {
      throw Error(std::string(op_name(op)), "args", std::string(op_name(op_of(args))) + "'s parameters",
                  std::string(op_name(op)) + "'s parameters (kernel '" + name + "' was selected for " +
                      std::string(op_name(op)) + ")");
    }
  };
  return Kernel{name,
                [same_op, launch = std::move(launch)](const OpArgs& args, const ExecContext& context) {
                  same_op(args);
                  launch(args, context);
                },
                [same_op, check = std::move(check)](const OpArgs& args) {
                  same_op(args);
                  if (check) check(args);
                }};
}

namespace detail {

DeviceChoice chosen_by(std::string_view anchor, Device where) {
  return {device_info_for(where),
          "; a call that names no device runs where its " + std::string(anchor) + " is (" + device_text(where) + ")"};
}

Selection select_or_throw(const Backend& backend, const OpArgs& args, const DeviceInfo& device, std::string_view chosen) {
  const Problem problem = problem_of(args, device);
  Selection s = backend.select(problem);
  if (!s) {
    throw Error(std::string(op_name(problem.op)),
                "backend '" + std::string(backend.name()) + "' cannot run this call: " + s.reason + std::string(chosen));
  }
  return s;
}

Kernel checked_kernel(const Backend& backend, const OpArgs& args, const DeviceInfo& device, std::string_view chosen) {
  Kernel kernel = *select_or_throw(backend, args, device, chosen).kernel;
  if (kernel.check) kernel.check(args);
  return kernel;
}

}  // namespace detail

void run(const Backend& backend, const OpArgs& args, const ExecContext& context) {
  const Anchor anchor = anchor_of(args);
  const detail::DeviceChoice chosen = detail::chosen_by(anchor.name, anchor.device);
  detail::select_or_throw(backend, args, chosen.device, chosen.why).kernel->launch(args, context);
}

void run(const Backend& backend, const OpArgs& args, const ExecContext& context, const DeviceInfo& device) {
  detail::select_or_throw(backend, args, device).kernel->launch(args, context);
}

const std::vector<const Backend*>& registered_backends() {
  static const std::vector<std::unique_ptr<Backend>> owned = detail::make_registered_backends();
  static const std::vector<const Backend*> views = [] {
    std::vector<const Backend*> v;
    for (const auto& b : owned) v.push_back(b.get());
    return v;
  }();
  return views;
}

const Backend* find_backend(std::string_view name) {
  for (const Backend* b : registered_backends()) {
    if (b->name() == name) return b;
  }
  return nullptr;
}

}  // namespace latentkv
