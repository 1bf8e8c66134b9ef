// Shared helpers for the torch-free CUDA layer: error propagation and dispatch macros.
// Every function in csrc/ that talks to CUDA returns cudaError_t; only csrc/bindings.cpp turns
// errors into Python exceptions.
#pragma once

#include <cuda_runtime.h>

// Return the error of a CUDA call from the enclosing function (which must return cudaError_t).
#define HICACHE_RETURN_IF_ERROR(call)         \
  do {                                        \
    cudaError_t hicache_err_ = (call);        \
    if (hicache_err_ != cudaSuccess) {        \
      return hicache_err_;                    \
    }                                         \
  } while (0)

// After a kernel launch: report configuration errors (bad grid, missing image) at once.
#define HICACHE_RETURN_LAUNCH_ERROR() HICACHE_RETURN_IF_ERROR(cudaGetLastError())

#ifndef HICACHE_ARCH_LIST
#define HICACHE_ARCH_LIST "unknown"
#endif
