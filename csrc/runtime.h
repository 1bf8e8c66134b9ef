// Torch-free runtime queries; each returns the CUDA error of the call it makes.
#pragma once

#include "common.cuh"

namespace hicache {

// CUDA runtime version this extension links statically (e.g. 13000 for 13.0).
cudaError_t runtime_version(int* version);
// Newest CUDA version the installed driver supports; 0 when no driver is installed.
cudaError_t driver_version(int* version);
cudaError_t device_count(int* count);
// binaryVersion / ptxVersion of this module's code for `device` (e.g. 90), asked of the driver for
// that device explicitly: the caller's current device and current context are left as they were.
// Fails with cudaErrorNoKernelImageForDevice when the build has no usable image for it, and with
// cudaErrorInvalidValue and argument_error() set (common.cuh) for a negative device.
cudaError_t kernel_image_versions(int device, int* binary_version, int* ptx_version);

namespace detail {
// kernel_image_versions of one kernel of this extension, given by its host stub (the address of the
// __global__ function), with argument errors reported as errors of `function`. Every .cu file is a
// module of its own, built for the same arch list, so each answers for the kernels it holds.
cudaError_t image_versions_of(const char* function, const void* kernel_stub, int device,
                              int* binary_version, int* ptx_version);
}  // namespace detail

}  // namespace hicache
