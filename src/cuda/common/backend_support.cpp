// What every CUDA backend's plan() checks first (backend_support.hpp).
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <variant>

#include "core/validate.hpp"
#include "cuda/common/backend_support.hpp"
#include "latentkv/backend.hpp"

namespace latentkv::cuda {

// plan() runs before a call's own checks (a DSA call plans its steps before their workspace views
// exist), so what the planners count and divide with is refused here as the call would refuse it:
// q's extents within 0 .. 2^31-1 (problem_of), at least one head, a decode's q_len within 1 ..
// kMaxDecodeQLen (q_len x heads are the query rows the split planner divides by), a page size of at
// least one token, and queries, index rows, logits, block tables, lengths and offsets whose
// descriptors the calls' shape checks would pass first (detail::expect_descriptor: a rank of at most
// kMaxRank, a DType, extents >= 0, a byte size that fits int64), and no more requests than a call
// takes.
void check_plan_extents(const OpArgs& args, const DeviceInfo& device) {
  const Problem p = problem_of(args, device);
  const std::string op(op_name(p.op));
  if (p.op != Op::kAppend && p.op != Op::kTopk) {
    const bool prefill = p.op == Op::kMlaPrefill || p.op == Op::kSparseMlaPrefill || p.op == Op::kIndexerPrefill;
    const bool indexer = p.op == Op::kIndexerLogits || p.op == Op::kIndexerPrefill;
    const std::string heads =
        std::string("q.shape[") + (prefill ? "1" : "2") + (indexer ? "] (indexer heads)" : "] (heads)");
    detail::expect_range(op, heads, p.heads, 1, indexer ? kMaxIndexerHeads : kMaxHeads);
  }
  if (p.op == Op::kMlaDecode || p.op == Op::kSparseMlaDecode || p.op == Op::kIndexerLogits) {
    detail::expect_decode_q_len(op, p.q_len);
  }
  if (p.op != Op::kAppend && p.page_size < 1) {
    detail::fail(op, p.op == Op::kTopk ? "page_size" : "cache.page_size", std::to_string(p.page_size), ">= 1");
  }
  std::visit(
      [&](const auto& a) {
        if constexpr (requires { a.q; }) detail::expect_descriptor(op, "q", a.q);
        if constexpr (requires { a.indices; }) detail::expect_descriptor(op, "indices", a.indices);
        if constexpr (requires { a.logits; }) detail::expect_descriptor(op, "logits", a.logits);
        if constexpr (requires { a.block_table; }) detail::expect_descriptor(op, "block_table", a.block_table);
        if constexpr (requires { a.seq_lens; }) detail::expect_descriptor(op, "seq_lens", a.seq_lens);
        if constexpr (requires { a.cu_new_tokens; }) detail::expect_descriptor(op, "cu_new_tokens", a.cu_new_tokens);
      },
      args);
  // The requests (query tokens of a sparse decode) the planners count in an int, at most as many as
  // the call takes: a grid dimension each for the decodes and the indexer, an int for the prefills.
  std::visit(
      [&](const auto& a) {
        using Args = std::decay_t<decltype(a)>;
        std::int64_t count = 0, most = kMaxGpuRequests;
        const char* arg = "q";
        const char* what = "requests (B)";
        if constexpr (std::is_same_v<Args, MlaDecodeParams> || std::is_same_v<Args, IndexerLogitsParams>) {
          count = a.q.size(0);
        } else if constexpr (std::is_same_v<Args, SparseMlaDecodeParams>) {
          count = a.q.size(0) * a.q.size(1);  // each within 2^31 (problem_of)
          what = "query tokens (B x q_len)";
        } else if constexpr (requires { a.cu_new_tokens; }) {
          count = a.seq_lens.size(0);
          most = std::numeric_limits<std::int32_t>::max();
          arg = "seq_lens";
        }
        if (count > most) {
          detail::fail(op, arg, std::to_string(count) + " " + what,
                       "at most " + std::to_string(most) + " per call on a GPU");
        }
      },
      args);
}

}  // namespace latentkv::cuda
