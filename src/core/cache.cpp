#include "latentkv/cache.hpp"

#include <string>

#include "latentkv/error.hpp"

namespace latentkv {

std::string_view kv_dtype_name(KvDtype dtype) { return dtype == KvDtype::kFp8E4M3 ? "fp8_e4m3" : "bf16"; }

KvDtype parse_kv_dtype(std::string_view name) {
  if (name == "fp8_e4m3" || name == "fp8") return KvDtype::kFp8E4M3;
  if (name == "bf16") return KvDtype::kBf16;
  throw Error("cache", "kv_dtype", quoted_value(name), "fp8_e4m3 or bf16");
}

std::size_t kv_token_bytes(KvDtype dtype) { return dtype == KvDtype::kFp8E4M3 ? kFp8TokenBytes : kBf16TokenBytes; }

}  // namespace latentkv
