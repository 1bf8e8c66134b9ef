// The numpy array type both extensions take and return int64 index arrays as: hicache._core
// (host/bindings.cpp) and hicache_kernels._C (bindings.cpp, index_faults). Header only.
#pragma once

#include <pybind11/numpy.h>

#include <cstdint>

namespace hicache {

// A C-contiguous int64 numpy array; an argument of another dtype or layout is converted (copied).
using Int64Array = pybind11::array_t<int64_t, pybind11::array::c_style>;

}  // namespace hicache
