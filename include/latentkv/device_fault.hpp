// latentkv/device_fault.hpp - bad values a GPU op found in inputs that live on the device.
//
// The host checks every shape before a launch, and the CPU reference checks every value too (slots
// and block-table pages inside the pool, lengths within the block table, no NaN in the latents,
// ...). A GPU op cannot have its device-resident values checked by the host without a round trip,
// and under a captured CUDA graph they change from replay to replay; so the kernels check them
// themselves, skip what they cannot use (a token the append would write wrongly is left unwritten, a
// page outside the pool is not read, a length is clamped to the block table) and, when the call is
// given a fault record, note a fault there (the first one recorded stays). After the stream has
// run, copy the record to the host and pass it to throw_device_fault(): it raises the Error the
// reference raises for that bad element, e.g.
//   append: argument 'latent element 1730' = nan: expected a finite value
//   mla_decode: argument 'block_table[3][17]' = 900000: expected a page id in 0 .. 7733 (request 3 uses 512 pages for 32768 tokens)
//   sparse_mla_decode: argument 'q element 4613' = inf: expected a finite value
#pragma once

#include <cstdint>

namespace latentkv {

// The op whose checks found the fault: the op the caller called (a prefill's checks name the
// prefill, not the kernels it runs). Numbered for the record (0: none), not as latentkv::Op.
enum class DeviceFaultOp : std::int32_t {
  kNone = 0,
  kAppend = 1,
  kMlaDecode = 2,
  kMlaPrefill = 3,
  kSparseMlaDecode = 4,
  kSparseMlaPrefill = 5,
  kIndexerLogits = 6,
  kTopk = 7,
  kIndexerPrefill = 8,
};

// What was wrong, and which fields of the record say more.
enum class DeviceFaultCode : std::int32_t {
  kNone = 0,
  kSlot = 1,             // element `index` of the slots (append) or indices (sparse ops) is `value`, outside -1 .. bound - 1
  kLatent = 2,           // append: latent element `index` (row-major [n, 576]) has bf16 bits `value`, not finite
  kIndexerKey = 3,       // append: indexer_keys element `index` ([n, 128]) has bf16 bits `value`, not finite
  kSeqLen = 4,           // seq_lens[index] = value, outside 0 .. `pages` x `page_size` (the block table's capacity)
  kSeqLenColumns = 5,    // seq_lens[index] = value, more than bound (the logits' max_len columns)
  kBlockTablePage = 6,   // block_table[index][position] = value, outside 0 .. bound - 1 (a page the request's `length` tokens use)
  kNewTokensStart = 7,   // cu_new_tokens[0] = value, not 0
  kNewTokensCount = 8,   // cu_new_tokens[index] = value, outside bound .. bound + length (request index - 1 has `length` tokens)
  kNewTokensEnd = 9,     // cu_new_tokens[index] = value, not bound (the new tokens, the rows of q)
  kQuery = 10,           // MLA ops: q element `index` (row-major, as its shape) has bf16 bits `value`, not finite
  kIndexerQuery = 11,    // indexer ops: q element `index` (row-major fp8) is code `value`, a NaN (0x7F, 0xFF)
  kWeight = 12,          // indexer ops: weights element `index` has float bits `value`, not finite
  kLogit = 13,           // topk: logits[index][length][position] is NaN at a position its row sees
};

// One record in device memory, owned by the caller and zeroed (all bytes 0: no fault) before the
// first call that is given it. A call writes it only while it holds no fault, so the first fault
// recorded stays until the caller zeroes the record again; one record may serve many calls (a whole
// captured step). With one bad value the record names what the reference names (a length past the
// block table is one fault, whatever its row holds past the capacity; a bad offset of a prefill is
// named as the reference names it, though it breaks two of its checks); with several, any one of
// them (the reference names the first it checks). GPU backends only: the reference throws the Error
// itself. The record must be 8-byte aligned (as cudaMalloc gives it); a call refuses one that is not.
struct DeviceFault {
  std::int32_t code = 0;       // a DeviceFaultCode
  std::int32_t op = 0;         // a DeviceFaultOp
  std::int64_t index = 0;      // the element, or the request
  std::int64_t position = 0;   // the page's place in the request's block-table row (kBlockTablePage), the column (kLogit)
  std::int64_t value = 0;      // the bad value (its bits or code for a non-finite element)
  std::int64_t bound = 0;      // the limit it broke, where there is one
  std::int64_t length = 0;     // the request's length (kBlockTablePage, kNewTokensCount); the query row (kLogit)
  std::int64_t pages = 0;      // the block table's pages per request (kSeqLen)
  std::int64_t page_size = 0;  // (kSeqLen, kBlockTablePage)
};
static_assert(sizeof(DeviceFault) == 64, "the kernels write the record at these offsets");

// Throws the Error for `fault` (a host copy of a record); returns when it holds no fault.
void throw_device_fault(const DeviceFault& fault);

}  // namespace latentkv
