#include "latentkv/version.hpp"

namespace latentkv {

const char* library_version() { return LATENTKV_VERSION; }

const char* library_build() { return LKV_BUILD_TEXT; }  // set by CMakeLists.txt

}  // namespace latentkv
