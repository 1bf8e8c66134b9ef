// Copy-engine helpers: fragments moved by cudaMemcpy*Async instead of SM kernels. Torch-free; every
// function returns the CUDA error of the first call that failed. Sizes and pitches are in BYTES.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace hicache {

// Copy `count` fragments described by HOST arrays: fragment k is `height[k]` rows of `width[k]`
// bytes, rows `src_pitch[k]` / `dst_pitch[k]` bytes apart, from address src[k] to dst[k]. A
// fragment with height 1, or whose rows are contiguous on both sides, is one cudaMemcpyAsync of
// width * height bytes; any other is one cudaMemcpy2DAsync. Empty fragments are skipped. Every
// fragment is checked before the first copy is issued: a negative size or pitch, or a pitch below
// the width for more than one row, returns cudaErrorInvalidValue with argument_error() naming it
// (common.cuh). Otherwise stops at and returns the first error of a copy.
cudaError_t memcpy_fragments(const int64_t* dst, const int64_t* dst_pitch, const int64_t* src,
                             const int64_t* src_pitch, const int64_t* width, const int64_t* height,
                             int64_t count, cudaStream_t stream);

enum MemcpyDirection : int { kDeviceToHost = 0, kHostToDevice = 1 };

// Copy `count` 1-D fragments (HOST arrays of addresses and byte sizes) in ONE cudaMemcpyBatchAsync
// with stream-ordered source access, host/device location hints for `direction` and
// PreferOverlapWithCompute; the device hint is the stream's device (cudaStreamGetDevice), not the
// current one. Argument errors, checked before any CUDA call, return cudaErrorInvalidValue with
// argument_error() naming the argument (common.cuh): a negative count or size, a direction other
// than kDeviceToHost / kHostToDevice, and the legacy default stream (NULL or cudaStreamLegacy),
// which cudaMemcpyBatchAsync refuses. cudaErrorNotSupported when built against CUDA < 12.8;
// otherwise the status of the CUDA calls (an empty argument_error() then: CUDA's own error).
cudaError_t memcpy_batch(const int64_t* dst, const int64_t* src, const int64_t* sizes,
                         int64_t count, int direction, cudaStream_t stream);

// The device address of pinned (mapped) host memory, for any address inside the allocation;
// differs from the host address on some platforms, so kernels must use this one.
// cudaErrorInvalidHostPointer for pageable or device memory.
cudaError_t host_device_pointer(const void* host, void** device);

}  // namespace hicache
