// Runtime facts the Python side cannot get from torch without a GPU, and a probe that asks the
// driver whether this build carries an image (cubin or JIT-able PTX) for a given device.
#include <cuda.h>  // driver API types only: entry points come from the runtime (no -lcuda)
#include <cudaTypedefs.h>

#include "runtime.h"

namespace hicache {

namespace {
// Never launched: its attributes tell whether the module has code for a device.
__global__ void image_probe_kernel(int* p) {
  if (p != nullptr) {
    *p = 0;
  }
}

// The driver's result codes used here have the same values as the runtime's (e.g.
// CUDA_ERROR_NO_BINARY_FOR_GPU == cudaErrorNoKernelImageForDevice == 209).
cudaError_t as_runtime_error(CUresult r) { return static_cast<cudaError_t>(r); }

// The driver API as of CUDA 12.0: the PFN_*_v* types below are the variants current then.
constexpr unsigned int kDriverAbi = 12000;

// A driver entry point, through the runtime so that this static build never links libcuda
// itself. cudaErrorCallRequiresNewerDriver when the driver lacks it.
template <class Fn>
cudaError_t driver_entry_point(const char* symbol, Fn* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  HICACHE_RETURN_IF_ERROR(
      cudaGetDriverEntryPointByVersion(symbol, &p, kDriverAbi, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || p == nullptr) {
    return cudaErrorCallRequiresNewerDriver;
  }
  *fn = reinterpret_cast<Fn>(p);
  return cudaSuccess;
}
}  // namespace

cudaError_t runtime_version(int* version) { return cudaRuntimeGetVersion(version); }

cudaError_t driver_version(int* version) { return cudaDriverGetVersion(version); }

cudaError_t device_count(int* count) { return cudaGetDeviceCount(count); }

namespace detail {

cudaError_t image_versions_of(const char* function, const void* kernel_stub, int device,
                              int* binary_version, int* ptx_version) {
  HICACHE_CHECK_ARG_OF(function, device >= 0, "device must be >= 0, got ", device);
  HICACHE_CHECK_ARG_OF(function, binary_version != nullptr && ptx_version != nullptr,
                       "binary_version and ptx_version must not be null");
  // cudaFuncGetAttributes answers for the CURRENT device only, and switching the caller's device
  // (even setting it back) changes which context is current on its thread. The driver's
  // cuKernelGetAttribute takes the device explicitly, on the context-independent kernel handle.
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 retain = nullptr;
  PFN_cuDevicePrimaryCtxRelease_v11000 release = nullptr;
  PFN_cuKernelGetAttribute_v12000 kernel_get_attribute = nullptr;
  HICACHE_RETURN_IF_ERROR(driver_entry_point("cuDeviceGet", &device_get));
  HICACHE_RETURN_IF_ERROR(driver_entry_point("cuDevicePrimaryCtxRetain", &retain));
  HICACHE_RETURN_IF_ERROR(driver_entry_point("cuDevicePrimaryCtxRelease", &release));
  HICACHE_RETURN_IF_ERROR(driver_entry_point("cuKernelGetAttribute", &kernel_get_attribute));
  cudaKernel_t kernel = nullptr;
  HICACHE_RETURN_IF_ERROR(cudaGetKernel(&kernel, kernel_stub));
  CUdevice dev = 0;
  HICACHE_RETURN_IF_ERROR(as_runtime_error(device_get(&dev, device)));
  // Hold the device's primary context (the one torch and the runtime use) for the query, so the
  // module can load there, without making it current; released again below.
  CUcontext primary = nullptr;
  HICACHE_RETURN_IF_ERROR(as_runtime_error(retain(&primary, dev)));
  int binary = 0;
  int ptx = 0;
  CUresult r = kernel_get_attribute(&binary, CU_FUNC_ATTRIBUTE_BINARY_VERSION,
                                    reinterpret_cast<CUkernel>(kernel), dev);
  if (r == CUDA_SUCCESS) {
    r = kernel_get_attribute(&ptx, CU_FUNC_ATTRIBUTE_PTX_VERSION,
                             reinterpret_cast<CUkernel>(kernel), dev);
  }
  const CUresult released = release(dev);
  HICACHE_RETURN_IF_ERROR(as_runtime_error(r));
  HICACHE_RETURN_IF_ERROR(as_runtime_error(released));
  *binary_version = binary;
  *ptx_version = ptx;
  return cudaSuccess;
}

}  // namespace detail

cudaError_t kernel_image_versions(int device, int* binary_version, int* ptx_version) {
  clear_argument_error();
  return detail::image_versions_of(__func__, reinterpret_cast<const void*>(image_probe_kernel),
                                   device, binary_version, ptx_version);
}

}  // namespace hicache
