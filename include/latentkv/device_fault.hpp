// latentkv/device_fault.hpp - bad values a GPU op found in inputs that live on the device.
//
// The host checks every shape before a launch, and the CPU reference checks every value too (slots
// inside the pool, no NaN in the latents, ...). A GPU op cannot have its device-resident values
// checked by the host without a round trip, and under a captured CUDA graph they change from replay
// to replay; so the kernel checks them itself, skips what it cannot use (a token it would write
// wrongly is left unwritten) and, when the call is given a fault record, notes a fault there (the
// first one recorded stays). After the stream has run, copy the record to the host and pass it to
// throw_device_fault(): it raises the Error the reference raises for that bad element, e.g.
//   append: argument 'latent element 1730' = nan: expected a finite value
#pragma once

#include <cstdint>

namespace latentkv {

enum class DeviceFaultCode : std::int32_t {
  kNone = 0,
  kAppendSlot = 1,         // append: slots[index] = value, outside -1 .. bound - 1
  kAppendLatent = 2,       // append: latent element `index` (row-major [n, 576]) has bf16 bits `value`, not finite
  kAppendIndexerKey = 3,   // append: indexer_keys element `index` ([n, 128]) has bf16 bits `value`, not finite
};

// One record in device memory, owned by the caller and zeroed (all bytes 0: no fault) before the
// first call that is given it. A call writes it only while it holds no fault, so the first fault
// recorded stays until the caller zeroes the record again. Within a token the record names what
// the reference would (its slot, else its lowest bad latent element, else its lowest bad key
// element); among several bad tokens, which is recorded first is not fixed, where the reference
// names the lowest. GPU backends only: the reference throws the Error itself.
struct DeviceFault {
  std::int32_t code = 0;   // a DeviceFaultCode
  std::int32_t unused = 0;
  std::int64_t index = 0;  // the element, as DeviceFaultCode says
  std::int64_t value = 0;  // the bad value (bf16 bits for a non-finite element)
  std::int64_t bound = 0;  // the limit it broke, where there is one
};
static_assert(sizeof(DeviceFault) == 32, "the kernels write the record at these offsets");

// Throws the Error for `fault` (a host copy of a record); returns when it holds no fault.
void throw_device_fault(const DeviceFault& fault);

}  // namespace latentkv
