// src/core/validate.hpp - argument checks shared by every backend.
//
// validate_shapes() looks only at descriptors and views (dtypes, shapes, devices, scalar fields) and
// is what every backend calls before launching. validate_values() reads index and input data and so
// needs them in host memory: the reference backend calls it, and device backends may call it on
// host copies. Both throw latentkv::Error naming the op, the argument, the value and what was
// expected; neither writes anything.
#pragma once

#include <string>
#include <string_view>

#include "latentkv/dtype.hpp"
#include "latentkv/ops.hpp"

namespace latentkv::detail {

// Which output dtypes a backend writes: the GPU backends write bf16 o and f32 lse; the reference
// also writes f32/f64 o and f64 lse.
enum class Outputs { kDeviceTypes, kReferenceTypes };

void validate_shapes(const AppendParams& p, Device device);
void validate_shapes(const MlaDecodeParams& p, Device device, Outputs outputs);
void validate_shapes(const MlaPrefillParams& p, Device device, Outputs outputs);
void validate_shapes(const IndexerLogitsParams& p, Device device);
void validate_shapes(const TopkParams& p, Device device);
void validate_shapes(const SparseMlaDecodeParams& p, Device device, Outputs outputs);
void validate_shapes(const SparseMlaPrefillParams& p, Device device, Outputs outputs);
void validate_shapes(const IndexerPrefillParams& p, Device device);

void validate_values(const AppendParams& p);
void validate_values(const MlaDecodeParams& p);
void validate_values(const MlaPrefillParams& p);
void validate_values(const IndexerLogitsParams& p);
void validate_values(const TopkParams& p);
void validate_values(const SparseMlaDecodeParams& p);
void validate_values(const SparseMlaPrefillParams& p);
void validate_values(const IndexerPrefillParams& p);

// Small helpers for other checks in the same style.
[[noreturn]] void fail(std::string_view op, std::string_view argument, const std::string& value,
                       const std::string& expected);
std::string describe(const TensorView& view);  // "bf16 [2, 1, 8, 576] on cuda"
// The errors of a bad slot (element `index` of `argument`, outside -1 .. num_slots - 1) and of a
// non-finite bf16 element: the reference's checks and the GPU's fault records (device_fault.cpp).
[[noreturn]] void fail_slot(std::string_view op, std::string_view argument, std::int64_t index, std::int64_t slot,
                            std::int64_t num_slots);
[[noreturn]] void fail_nonfinite_bf16(std::string_view op, std::string_view argument, std::int64_t index,
                                      std::uint16_t bits);

}  // namespace latentkv::detail
