// Sparse MLA decode and prefill (SPEC section 4.6): each query row attends to the slots of its index row.
#include <vector>

#include "core/validate.hpp"
#include "cpu/common.hpp"
#include "cpu/reference.hpp"

namespace latentkv::cpu {
namespace {

// Query rows 0 .. rows-1 of q ([rows, heads, 576]), row r attending to indices[r] ([rows, topk]).
// -1 entries are skipped. A slot listed twice is attended twice (its weight doubles): that is what a
// kernel that simply gathers the listed slots computes, so the reference does the same.
void sparse_attend(const TensorView& q, const LatentCache& cache,
                   const std::int32_t* indices,  // [rows, topk] physical slots or -1
                   std::int64_t rows, std::int64_t topk, int heads, double scale, const TensorView& o,
                   const TensorView& lse) {
  std::vector<double> q_row(static_cast<std::size_t>(heads) * kQkDim);      // [heads, 576]
  std::vector<double> o_row(static_cast<std::size_t>(heads) * kLatentDim);  // [heads, 512]
  std::vector<double> lse_row(static_cast<std::size_t>(heads));             // [heads]
  std::vector<std::int64_t> slots;
  std::vector<float> keys;  // [slots, 576]
  for (std::int64_t r = 0; r < rows; ++r) {
    slots.clear();
    for (std::int64_t k = 0; k < topk; ++k) {
      const std::int32_t slot = indices[r * topk + k];
      if (slot >= 0) slots.push_back(slot);
    }
    internal::gather_tokens(cache, slots, keys);
    internal::load_query(q, r, heads, q_row.data());
    internal::attend(q_row.data(), heads, keys.data(), static_cast<std::int64_t>(slots.size()), scale, o_row.data(),
                   lse_row.data());
    internal::store_outputs(o, lse, r, heads, o_row.data(), lse_row.data());
  }
}

}  // namespace

void sparse_mla_decode(const SparseMlaDecodeParams& p) {
  latentkv::detail::validate_shapes(p, Device::cpu(), latentkv::detail::Outputs::kReferenceTypes);
  latentkv::detail::validate_values(p);
  const std::int64_t rows = p.q.size(0) * p.q.size(1);  // B * q_len
  sparse_attend(p.q, p.cache, p.indices.as<const std::int32_t>(), rows, p.indices.size(2),
                static_cast<int>(p.q.size(2)), p.softmax_scale, p.o, p.lse);
}

void sparse_mla_prefill(const SparseMlaPrefillParams& p) {
  latentkv::detail::validate_shapes(p, Device::cpu(), latentkv::detail::Outputs::kReferenceTypes);
  latentkv::detail::validate_values(p);
  sparse_attend(p.q, p.cache, p.indices.as<const std::int32_t>(), p.q.size(0), p.indices.size(1),
                static_cast<int>(p.q.size(1)), p.softmax_scale, p.o, p.lse);
}

}  // namespace latentkv::cpu
