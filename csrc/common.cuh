// Shared helpers for the torch-free CUDA layer: error propagation, argument checks and dispatch
// macros. Every function in csrc/ that talks to CUDA returns cudaError_t; only csrc/bindings.cpp
// turns errors into Python exceptions.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <string>

// Return the error of a CUDA call from the enclosing function (which must return cudaError_t).
#define HICACHE_RETURN_IF_ERROR(call)  \
  do {                                 \
    cudaError_t hicache_err_ = (call); \
    if (hicache_err_ != cudaSuccess) { \
      return hicache_err_;             \
    }                                  \
  } while (0)

// After a kernel launch: report configuration errors (bad grid, missing image) at once.
#define HICACHE_RETURN_LAUNCH_ERROR() HICACHE_RETURN_IF_ERROR(cudaGetLastError())

#ifndef HICACHE_ARCH_LIST
#define HICACHE_ARCH_LIST "unknown"
#endif

namespace hicache {

// Argument errors. An entry point that checks its arguments calls clear_argument_error() first;
// a check that fails records "<function>: <argument> <rule>, got <value>" for the calling thread
// and returns cudaErrorInvalidValue (HICACHE_CHECK_ARG). So after such a call, a non-empty
// argument_error() means the call was refused for that argument before any CUDA call, and an empty
// one with cudaErrorInvalidValue means CUDA itself returned it.
void clear_argument_error();
const char* argument_error();
cudaError_t set_argument_error(std::string message);  // always returns cudaErrorInvalidValue

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

}  // namespace hicache

// Refuse an argument: unless `cond` holds, record `function` followed by the message parts
// (streamed, e.g. "warps_per_block must be in [1, 32], got ", warps_per_block) and return
// cudaErrorInvalidValue from the enclosing function. HICACHE_CHECK_ARG names the enclosing function
// itself; helpers that check on behalf of an entry point pass its name to HICACHE_CHECK_ARG_OF.
#define HICACHE_CHECK_ARG_OF(function, cond, ...)                  \
  do {                                                             \
    if (!(cond)) {                                                 \
      return ::hicache::set_argument_error(                        \
          ::hicache::detail::concat(function, ": ", __VA_ARGS__)); \
    }                                                              \
  } while (0)
#define HICACHE_CHECK_ARG(cond, ...) HICACHE_CHECK_ARG_OF(__func__, cond, __VA_ARGS__)
