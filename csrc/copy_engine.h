// Copy-engine helpers: fragments moved by cudaMemcpy*Async instead of SM kernels. Torch-free; every
// function returns the CUDA error of the first call that failed. Sizes and pitches are in BYTES.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace hicache {

// Copy `count` fragments described by HOST arrays: fragment k is `height[k]` rows of `width[k]`
// bytes, rows `src_pitch[k]` / `dst_pitch[k]` bytes apart, from address src[k] to dst[k]. A
// fragment with height 1, or whose rows are contiguous on both sides, is one cudaMemcpyAsync of
// width * height bytes; any other is one cudaMemcpy2DAsync. Empty fragments are skipped. Stops at
// and returns the first error (cudaErrorInvalidValue for negative sizes).
cudaError_t memcpy_fragments(const int64_t* dst, const int64_t* dst_pitch, const int64_t* src,
                             const int64_t* src_pitch, const int64_t* width,
                             const int64_t* height, int64_t count, cudaStream_t stream);

enum MemcpyDirection : int { kDeviceToHost = 0, kHostToDevice = 1 };

// Copy `count` 1-D fragments (HOST arrays of addresses and byte sizes) in ONE cudaMemcpyBatchAsync
// with stream-ordered source access, host/device location hints for `direction` and
// PreferOverlapWithCompute. Errors: cudaErrorInvalidResourceHandle for the legacy default stream
// (which the call refuses), cudaErrorNotSupported when built against CUDA < 12.8,
// cudaErrorInvalidValue for a bad direction or a negative size; otherwise the call's own status.
cudaError_t memcpy_batch(const int64_t* dst, const int64_t* src, const int64_t* sizes,
                         int64_t count, int direction, cudaStream_t stream);

// The device address of pinned (mapped) host memory, for any address inside the allocation;
// differs from the host address on some platforms, so kernels must use this one.
// cudaErrorInvalidHostPointer for pageable or device memory.
cudaError_t host_device_pointer(const void* host, void** device);

}  // namespace hicache
