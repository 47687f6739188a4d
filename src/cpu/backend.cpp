// The CPU reference registered as the backend "reference".
#include <memory>
#include <string>

#include "latentkv/backend.hpp"
#include "cpu/reference.hpp"

namespace latentkv {
namespace {

class ReferenceBackend final : public Backend {
 public:
  std::string_view name() const override { return "reference"; }
  std::string_view description() const override {
    return "CPU reference: float64 over the dequantized cache bytes; every op, every shape; slow";
  }
  int preference() const override { return 0; }  // chosen by `auto` only where nothing else runs

  Selection select(const Problem& problem) const override {
    if (problem.device.kind != DeviceKind::kCpu) {
      return Selection::no("runs on the CPU only (device is " + problem.device.name + ")");
    }
    const bool indexer = problem.op == Op::kIndexerLogits || problem.op == Op::kIndexerPrefill;
    const int max_heads = indexer ? kMaxIndexerHeads : kMaxHeads;
    if (problem.heads > max_heads) {
      return Selection::no(std::string(indexer ? "indexer heads " : "heads ") + std::to_string(problem.heads) +
                           " outside 1 .. " + std::to_string(max_heads));
    }
    return Selection::yes(make_kernel(problem.op, "reference." + std::string(op_name(problem.op)), launch),
                          "float64 reference");
  }

 private:
  static void launch(const OpArgs& args, const ExecContext&) {
    std::visit(
        [](const auto& p) {
          using T = std::decay_t<decltype(p)>;
          if constexpr (std::is_same_v<T, AppendParams>) cpu::append(p);
          else if constexpr (std::is_same_v<T, MlaDecodeParams>) cpu::mla_decode(p);
          else if constexpr (std::is_same_v<T, MlaPrefillParams>) cpu::mla_prefill(p);
          else if constexpr (std::is_same_v<T, IndexerLogitsParams>) cpu::indexer_logits(p);
          else if constexpr (std::is_same_v<T, TopkParams>) cpu::topk(p);
          else if constexpr (std::is_same_v<T, SparseMlaDecodeParams>) cpu::sparse_mla_decode(p);
          else if constexpr (std::is_same_v<T, SparseMlaPrefillParams>) cpu::sparse_mla_prefill(p);
          else cpu::indexer_prefill(p);
        },
        args);
  }
};

}  // namespace

std::unique_ptr<Backend> make_backend_reference() { return std::make_unique<ReferenceBackend>(); }

}  // namespace latentkv
