// The only file that knows about Python. Arguments are plain integers (device pointers, sizes,
// strides, stream handles), so this module never includes or links torch and one build serves any
// torch version.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "runtime.h"

namespace py = pybind11;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
  }
}

py::dict build_info() {
  py::dict d;
  d["archs"] = HICACHE_ARCH_LIST;
  d["cuda_version"] = CUDART_VERSION;
  d["cudart"] = "static";
  return d;
}

int runtime_version() {
  int v = 0;
  check(hicache::runtime_version(&v), "cudaRuntimeGetVersion");
  return v;
}

int driver_version() {
  int v = 0;
  check(hicache::driver_version(&v), "cudaDriverGetVersion");
  return v;
}

int device_count() {
  int n = 0;
  check(hicache::device_count(&n), "cudaGetDeviceCount");
  return n;
}

py::tuple kernel_image_versions(int device) {
  int binary = 0;
  int ptx = 0;
  check(hicache::kernel_image_versions(device, &binary, &ptx), "cudaFuncGetAttributes");
  return py::make_tuple(binary, ptx);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hicache-kernels CUDA extension (torch-free; static CUDA runtime)";
  m.def("build_info", &build_info, "Archs compiled in and the CUDA version built against.");
  m.def("runtime_version", &runtime_version, "Version of the statically linked CUDA runtime.");
  m.def("driver_version", &driver_version, "CUDA version the driver supports; 0 without a driver.");
  m.def("device_count", &device_count, "Number of CUDA devices; raises without a driver.");
  m.def("kernel_image_versions", &kernel_image_versions, py::arg("device"),
        "(binaryVersion, ptxVersion) of this build's code for the device; raises when none fits.");
}
