// src/core/selection.hpp - a backend's selection for one call, as run() makes it (backend.cpp).
#pragma once

#include "latentkv/backend.hpp"

namespace latentkv::detail {

// What `backend` selects for `args` on `device`; throws the Error run() throws when it refuses, so
// that a call of several steps (dsa.cpp) can ask every step's backend before it queues any step.
Selection select_or_throw(const Backend& backend, const OpArgs& args, const DeviceInfo& device);

// The kernel select_or_throw finds, after its own checks of the call (Kernel::check): whatever run()
// would refuse without reading the data is refused here, so that a call of several steps has every
// step accepted before it queues the first.
Kernel checked_kernel(const Backend& backend, const OpArgs& args, const DeviceInfo& device);

}  // namespace latentkv::detail
