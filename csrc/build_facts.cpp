// The only translation unit that sees the arch list: setup.py defines HICACHE_ARCH_LIST for this
// file alone, so a new arch list recompiles this file and the kernels, never the pybind11 bindings.
#include "build_facts.h"

#ifndef HICACHE_ARCH_LIST
#error "HICACHE_ARCH_LIST is not defined: build the extension through setup.py"
#endif

namespace hicache {

const char* arch_list() { return HICACHE_ARCH_LIST; }

}  // namespace hicache
