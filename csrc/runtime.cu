// Runtime facts the Python side cannot get from torch without a GPU, and a probe that asks the
// driver whether this build carries an image (cubin or JIT-able PTX) for a given device.
#include "runtime.h"

namespace hicache {

namespace {
// Never launched: its attributes tell whether the module has code for the current device.
__global__ void image_probe_kernel(int* p) {
  if (p != nullptr) {
    *p = 0;
  }
}
}  // namespace

cudaError_t runtime_version(int* version) { return cudaRuntimeGetVersion(version); }

cudaError_t driver_version(int* version) { return cudaDriverGetVersion(version); }

cudaError_t device_count(int* count) { return cudaGetDeviceCount(count); }

cudaError_t kernel_image_versions(int device, int* binary_version, int* ptx_version) {
  int previous = 0;
  HICACHE_RETURN_IF_ERROR(cudaGetDevice(&previous));
  HICACHE_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaFuncAttributes attr{};
  cudaError_t err = cudaFuncGetAttributes(&attr, image_probe_kernel);
  cudaError_t restore = cudaSetDevice(previous);
  HICACHE_RETURN_IF_ERROR(err);
  HICACHE_RETURN_IF_ERROR(restore);
  *binary_version = attr.binaryVersion;
  *ptx_version = attr.ptxVersion;
  return cudaSuccess;
}

}  // namespace hicache
