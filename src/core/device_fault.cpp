// throw_device_fault: a GPU op's fault record as the reference's Error for the same input.
#include "latentkv/device_fault.hpp"

#include <string>

#include "core/validate.hpp"
#include "latentkv/error.hpp"

namespace latentkv {

void throw_device_fault(const DeviceFault& f) {
  switch (static_cast<DeviceFaultCode>(f.code)) {
    case DeviceFaultCode::kNone:
      return;
    case DeviceFaultCode::kAppendSlot:
      detail::fail_slot("append", "slots", f.index, f.value, f.bound);
    case DeviceFaultCode::kAppendLatent:
      detail::fail_nonfinite_bf16("append", "latent", f.index, static_cast<std::uint16_t>(f.value));
    case DeviceFaultCode::kAppendIndexerKey:
      detail::fail_nonfinite_bf16("append", "indexer_keys", f.index, static_cast<std::uint16_t>(f.value));
  }
  throw Error("device fault", "code", std::to_string(f.code),
              "a DeviceFaultCode (the record is not one a latentkv kernel wrote, or it was not zeroed)");
}

}  // namespace latentkv
