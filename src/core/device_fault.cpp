// throw_device_fault: a GPU op's fault record as the reference's Error for the same input.
#include "latentkv/device_fault.hpp"

#include <bit>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/validate.hpp"
#include "latentkv/error.hpp"

namespace latentkv {
namespace {

[[noreturn]] void fail_record(const std::string& field, std::int64_t value, const std::string& expected) {
  throw Error("device fault", field, std::to_string(value),
              expected + " (the record is not one a latentkv kernel wrote, or it was not zeroed)");
}

std::string_view op_name(const DeviceFault& f) {
  switch (static_cast<DeviceFaultOp>(f.op)) {
    case DeviceFaultOp::kAppend: return "append";
    case DeviceFaultOp::kMlaDecode: return "mla_decode";
    case DeviceFaultOp::kMlaPrefill: return "mla_prefill";
    case DeviceFaultOp::kSparseMlaDecode: return "sparse_mla_decode";
    case DeviceFaultOp::kSparseMlaPrefill: return "sparse_mla_prefill";
    case DeviceFaultOp::kIndexerLogits: return "indexer_logits";
    case DeviceFaultOp::kTopk: return "topk";
    case DeviceFaultOp::kIndexerPrefill: return "indexer_prefill";
    case DeviceFaultOp::kNone: break;
  }
  fail_record("op", f.op, "a DeviceFaultOp");
}

}  // namespace

void throw_device_fault(const DeviceFault& f) {
  if (f.code == static_cast<std::int32_t>(DeviceFaultCode::kNone)) return;
  const std::string_view op = op_name(f);
  switch (static_cast<DeviceFaultCode>(f.code)) {
    case DeviceFaultCode::kSlot:
      detail::fail_slot(op, op == "append" ? "slots" : "indices", f.index, f.value, f.bound);
    case DeviceFaultCode::kLatent:
      detail::fail_nonfinite_bf16(op, "latent", f.index, static_cast<std::uint16_t>(f.value));
    case DeviceFaultCode::kIndexerKey:
      detail::fail_nonfinite_bf16(op, "indexer_keys", f.index, static_cast<std::uint16_t>(f.value));
    case DeviceFaultCode::kSeqLen:
      detail::fail_seq_len(op, f.index, f.value, f.pages, f.page_size);
    case DeviceFaultCode::kSeqLenColumns:
      detail::fail_seq_len_columns(op, f.index, f.value, f.bound);
    case DeviceFaultCode::kBlockTablePage:
      if (f.page_size < 1) fail_record("page_size", f.page_size, ">= 1");
      detail::fail_block_table_page(op, f.index, f.position, f.value, f.bound, f.length, f.page_size);
    case DeviceFaultCode::kNewTokensStart:
      detail::fail_new_tokens_start(op, f.value);
    case DeviceFaultCode::kNewTokensCount:
      detail::fail_new_tokens_count(op, f.index, f.value, f.bound, f.length);
    case DeviceFaultCode::kNewTokensEnd:
      detail::fail_new_tokens_end(op, f.index, f.value, f.bound);
    case DeviceFaultCode::kQuery:
      detail::fail_nonfinite_bf16(op, "q", f.index, static_cast<std::uint16_t>(f.value));
    case DeviceFaultCode::kIndexerQuery:
      detail::fail_nan_fp8(op, "q", f.index, static_cast<std::uint8_t>(f.value));
    case DeviceFaultCode::kWeight:
      detail::fail_nonfinite_f32(op, "weights", f.index, std::bit_cast<float>(static_cast<std::uint32_t>(f.value)));
    case DeviceFaultCode::kLogit:
      detail::fail_nan_logit(op, f.index, f.length, f.position);
    case DeviceFaultCode::kNone:
      break;
  }
  fail_record("code", f.code, "a DeviceFaultCode");
}

}  // namespace latentkv
