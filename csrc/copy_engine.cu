// Copy-engine helpers (declarations and contracts: copy_engine.h).
#include <cstddef>
#include <vector>

#include "copy_engine.h"

namespace hicache {

cudaError_t memcpy_fragments(const int64_t* dst, const int64_t* dst_pitch, const int64_t* src,
                             const int64_t* src_pitch, const int64_t* width, const int64_t* height,
                             int64_t count, cudaStream_t stream) {
  clear_argument_error();
  HICACHE_CHECK_ARG(count >= 0, "count must be >= 0, got ", count);
  if (count == 0) {
    return cudaSuccess;
  }
  HICACHE_CHECK_ARG(
      dst != nullptr && dst_pitch != nullptr && src != nullptr && src_pitch != nullptr &&
          width != nullptr && height != nullptr,
      "dst, dst_pitch, src, src_pitch, width and height must not be null when count > 0");
  // Check every fragment before issuing any copy: a refused call has copied nothing.
  for (int64_t k = 0; k < count; ++k) {
    HICACHE_CHECK_ARG(width[k] >= 0, "width[", k, "] must be >= 0, got ", width[k]);
    HICACHE_CHECK_ARG(height[k] >= 0, "height[", k, "] must be >= 0, got ", height[k]);
    HICACHE_CHECK_ARG(dst_pitch[k] >= 0, "dst_pitch[", k, "] must be >= 0, got ", dst_pitch[k]);
    HICACHE_CHECK_ARG(src_pitch[k] >= 0, "src_pitch[", k, "] must be >= 0, got ", src_pitch[k]);
    if (height[k] > 1) {  // rows must not overlap
      HICACHE_CHECK_ARG(dst_pitch[k] >= width[k], "dst_pitch[", k, "] must be >= width[", k, "] (",
                        width[k], ") for more than one row, got ", dst_pitch[k]);
      HICACHE_CHECK_ARG(src_pitch[k] >= width[k], "src_pitch[", k, "] must be >= width[", k, "] (",
                        width[k], ") for more than one row, got ", src_pitch[k]);
    }
  }
  for (int64_t k = 0; k < count; ++k) {
    if (width[k] == 0 || height[k] == 0) {
      continue;
    }
    void* d = reinterpret_cast<void*>(dst[k]);
    const void* s = reinterpret_cast<const void*>(src[k]);
    if (height[k] == 1 || (src_pitch[k] == width[k] && dst_pitch[k] == width[k])) {
      HICACHE_RETURN_IF_ERROR(cudaMemcpyAsync(d, s, static_cast<size_t>(width[k] * height[k]),
                                              cudaMemcpyDefault, stream));
    } else {
      HICACHE_RETURN_IF_ERROR(
          cudaMemcpy2DAsync(d, static_cast<size_t>(dst_pitch[k]), s,
                            static_cast<size_t>(src_pitch[k]), static_cast<size_t>(width[k]),
                            static_cast<size_t>(height[k]), cudaMemcpyDefault, stream));
    }
  }
  return cudaSuccess;
}

cudaError_t memcpy_batch(const int64_t* dst, const int64_t* src, const int64_t* sizes,
                         int64_t count, int direction, cudaStream_t stream) {
  clear_argument_error();
  HICACHE_CHECK_ARG(count >= 0, "count must be >= 0, got ", count);
  HICACHE_CHECK_ARG(direction == kDeviceToHost || direction == kHostToDevice,
                    "direction must be 0 (device to host) or 1 (host to device), got ", direction);
  HICACHE_CHECK_ARG(stream != nullptr && stream != cudaStreamLegacy,
                    "stream must not be the legacy default stream (cudaMemcpyBatchAsync refuses "
                    "it), got handle ",
                    reinterpret_cast<const void*>(stream));
  if (count == 0) {
    return cudaSuccess;
  }
  HICACHE_CHECK_ARG(dst != nullptr && src != nullptr && sizes != nullptr,
                    "dst, src and sizes must not be null when count > 0");
  for (int64_t k = 0; k < count; ++k) {
    HICACHE_CHECK_ARG(sizes[k] >= 0, "sizes[", k, "] must be >= 0, got ", sizes[k]);
  }
#if CUDART_VERSION >= 12080
  std::vector<void*> dsts(static_cast<size_t>(count));
  std::vector<void*> srcs(static_cast<size_t>(count));
  std::vector<size_t> bytes(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) {
    dsts[k] = reinterpret_cast<void*>(dst[k]);
    srcs[k] = reinterpret_cast<void*>(src[k]);
    bytes[k] = static_cast<size_t>(sizes[k]);
  }
  // The device end of every piece is on the stream's device, whatever device is current.
  int device = 0;
  HICACHE_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &device));
  cudaMemLocation host_loc{};
  host_loc.type = cudaMemLocationTypeHost;
  cudaMemLocation device_loc{};
  device_loc.type = cudaMemLocationTypeDevice;
  device_loc.id = device;
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint = direction == kDeviceToHost ? device_loc : host_loc;
  attr.dstLocHint = direction == kDeviceToHost ? host_loc : device_loc;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;  // the one attribute applies from fragment 0 on
#if CUDART_VERSION >= 13000
  const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), bytes.data(), bytes.size(),
                                               &attr, &attr_index, 1, stream);
#else
  size_t fail_index = 0;
  const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), bytes.data(), bytes.size(),
                                               &attr, &attr_index, 1, &fail_index, stream);
#endif
  if (err != cudaSuccess) {
    // The caller may fall back to other copies: leave no error behind for the next launch check.
    (void)cudaGetLastError();
  }
  return err;
#else
  return cudaErrorNotSupported;
#endif
}

cudaError_t host_device_pointer(const void* host, void** device) {
  *device = nullptr;
  // Pointer attributes resolve any address inside a pinned allocation (a tensor view starts at an
  // offset); cudaHostGetDevicePointer is only documented for the allocation's own start.
  cudaPointerAttributes attr{};
  HICACHE_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, host));
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) {
    return cudaErrorInvalidHostPointer;  // pageable (unregistered) or not host memory at all
  }
  *device = attr.devicePointer;
  return cudaSuccess;
}

}  // namespace hicache
