// src/core/selection.hpp - a backend's selection for one call, as run() makes it (backend.cpp).
#pragma once

#include <string>
#include <string_view>

#include "latentkv/backend.hpp"

namespace latentkv::detail {

// Where a call names no device: the device its memory at `where` chooses (device_info_for), and the
// words a refusal ends with, naming the view (`anchor`) that chose it: "; a call that names no
// device runs where its cache.device is (cpu)".
struct DeviceChoice {
  DeviceInfo device;
  std::string why;
};
DeviceChoice chosen_by(std::string_view anchor, Device where);

// What `backend` selects for `args` on `device`; throws the Error run() throws when it refuses
// (ending with `chosen`, chosen_by's words where the caller named no device), so that a call of
// several steps (dsa.cpp) can ask every step's backend before it queues any step.
Selection select_or_throw(const Backend& backend, const OpArgs& args, const DeviceInfo& device,
                          std::string_view chosen = {});

// The kernel select_or_throw finds, after its own checks of the call (Kernel::check): whatever run()
// would refuse without reading the data is refused here, so that a call of several steps has every
// step accepted before it queues the first.
Kernel checked_kernel(const Backend& backend, const OpArgs& args, const DeviceInfo& device,
                      std::string_view chosen = {});

}  // namespace latentkv::detail
