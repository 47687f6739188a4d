#include "latentkv/version.hpp"

namespace latentkv {

const char* library_version() { return LATENTKV_VERSION; }

const char* library_build() { return LKV_BUILD_TEXT; }  // set by CMakeLists.txt

const char* library_description() { return LATENTKV_VERSION " (" LKV_BUILD_TEXT ")"; }

}  // namespace latentkv
