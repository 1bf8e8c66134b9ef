// The CUDA extension's only file that knows about Python: transfers, the copy engine, runtime
// facts and two host-side helpers of the kernel package (same_items, index_faults). Arguments are
// plain integers (device pointers, sizes, strides, stream handles), so this module never includes
// or links torch and one build serves any torch version. The cache layer's host core (radix tree,
// page stack, candidates, checksums) is another extension, hicache._core (host/bindings.cpp).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "build_facts.h"
#include "copy_engine.h"
#include "host/py_arrays.h"
#include "runtime.h"
#include "transfer.h"

namespace py = pybind11;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
  }
}

// For the entry points that check their arguments (they reset the record first): a refused
// argument is a ValueError naming it (common.cuh); cudaErrorInvalidValue from CUDA itself is not.
void raise_argument_error(cudaError_t err) {
  if (err == cudaErrorInvalidValue && *hicache::argument_error() != '\0') {
    throw py::value_error(hicache::argument_error());
  }
}

// check() for the entry points that check their arguments.
void check_args(cudaError_t err, const char* what) {
  raise_argument_error(err);
  check(err, what);
}

py::dict build_info() {
  py::dict d;
  d["archs"] = hicache::arch_list();
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
  check_args(hicache::kernel_image_versions(device, &binary, &ptx),
             "kernel_image_versions (cuKernelGetAttribute)");
  return py::make_tuple(binary, ptx);
}

py::tuple bulk_image_versions(int device) {
  int binary = 0;
  int ptx = 0;
  check_args(hicache::bulk_image_versions(device, &binary, &ptx),
             "bulk_image_versions (cuKernelGetAttribute)");
  return py::make_tuple(binary, ptx);
}

cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

template <class T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// A side of a transfer: the 9 integers of plan.Side.desc().
hicache::SideDesc side_desc(const py::sequence& desc, const char* name) {
  if (py::len(desc) != 9) {
    throw py::value_error(std::string(name) +
                          ": expected 9 ints (base, num_layers, s_kv, s_layer, s_page, "
                          "s_in_page, s_chunk, page_size, num_slots), got " +
                          std::to_string(py::len(desc)));
  }
  int64_t v[9];
  for (int k = 0; k < 9; ++k) {
    v[k] = desc[k].cast<int64_t>();
  }
  return hicache::SideDesc{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]};
}

void transfer(const py::sequence& src_desc, bool src_table, const py::sequence& dst_desc,
              bool dst_table, std::uintptr_t src_idx_ptr, std::uintptr_t dst_idx_ptr, int64_t n,
              int layer_begin, int layer_count, int num_kv, int num_chunks, int64_t chunk_bytes,
              int64_t align_bytes, int num_blocks, int warps_per_block,
              std::uintptr_t oob_count_ptr, std::uintptr_t stream, bool dst_host) {
  const hicache::SideDesc src = side_desc(src_desc, "src_desc");
  const hicache::SideDesc dst = side_desc(dst_desc, "dst_desc");
  cudaError_t err;
  {
    py::gil_scoped_release release;
    err = hicache::launch_transfer(
        src, src_table, dst, dst_table, as_ptr<const int64_t>(src_idx_ptr),
        as_ptr<const int64_t>(dst_idx_ptr), n, layer_begin, layer_count, num_kv, num_chunks,
        chunk_bytes, align_bytes, num_blocks, warps_per_block, as_ptr<int>(oob_count_ptr),
        as_stream(stream), dst_host);
  }
  check_args(err, "launch_transfer");
}

void transfer_bulk(const py::sequence& src_desc, bool src_table, const py::sequence& dst_desc,
                   bool dst_table, std::uintptr_t src_idx_ptr, std::uintptr_t dst_idx_ptr,
                   int64_t n, int layer_begin, int layer_count, int num_kv, int num_chunks,
                   int64_t chunk_bytes, int64_t align_bytes, int num_blocks, int warps_per_block,
                   std::uintptr_t oob_count_ptr, std::uintptr_t stream) {
  const hicache::SideDesc src = side_desc(src_desc, "src_desc");
  const hicache::SideDesc dst = side_desc(dst_desc, "dst_desc");
  cudaError_t err;
  {
    py::gil_scoped_release release;
    err = hicache::launch_transfer_bulk(
        src, src_table, dst, dst_table, as_ptr<const int64_t>(src_idx_ptr),
        as_ptr<const int64_t>(dst_idx_ptr), n, layer_begin, layer_count, num_kv, num_chunks,
        chunk_bytes, align_bytes, num_blocks, warps_per_block, as_ptr<int>(oob_count_ptr),
        as_stream(stream));
  }
  check_args(err, "launch_transfer_bulk");
}

// Host emulation of transfer_bulk: index arrays and tables are host addresses.
py::dict bulk_schedule(const py::sequence& src_desc, bool src_table, const py::sequence& dst_desc,
                       bool dst_table, std::uintptr_t src_idx_ptr, std::uintptr_t dst_idx_ptr,
                       int64_t n, int layer_begin, int layer_count, int num_kv, int num_chunks,
                       int64_t chunk_bytes, int64_t align_bytes, int num_blocks,
                       int warps_per_block) {
  const hicache::SideDesc src = side_desc(src_desc, "src_desc");
  const hicache::SideDesc dst = side_desc(dst_desc, "dst_desc");
  std::vector<hicache::BulkCopy> copies;
  int64_t oob = 0;
  int64_t blocks = 0;
  int64_t stages = 0;
  int64_t stage_bytes = 0;
  check_args(
      hicache::bulk_schedule(src, src_table, dst, dst_table, as_ptr<const int64_t>(src_idx_ptr),
                             as_ptr<const int64_t>(dst_idx_ptr), n, layer_begin, layer_count,
                             num_kv, num_chunks, chunk_bytes, align_bytes, num_blocks,
                             warps_per_block, &copies, &oob, &blocks, &stages, &stage_bytes),
      "bulk_schedule");
  py::list out;
  for (const hicache::BulkCopy& c : copies) {
    out.append(
        py::make_tuple(c.block, c.round, c.slot, c.parity, c.smem_offset, c.src, c.dst, c.bytes));
  }
  py::dict d;
  d["copies"] = out;
  d["oob_count"] = oob;
  d["blocks"] = blocks;
  d["stages"] = stages;
  d["stage_bytes"] = stage_bytes;
  d["max_stages"] = hicache::bulk_ring_stages();
  d["max_stage_bytes"] = hicache::bulk_stage_bytes();
  return d;
}

int vector_bytes(int64_t align_bytes) {
  if (align_bytes < 0) {
    throw py::value_error("align_bytes: must be >= 0, got " + std::to_string(align_bytes));
  }
  return hicache::vector_bytes(align_bytes);
}

void memcpy_fragments(std::uintptr_t dst_ptr, std::uintptr_t dst_pitch_ptr, std::uintptr_t src_ptr,
                      std::uintptr_t src_pitch_ptr, std::uintptr_t width_ptr,
                      std::uintptr_t height_ptr, int64_t count, std::uintptr_t stream) {
  cudaError_t err;
  {
    py::gil_scoped_release release;
    err = hicache::memcpy_fragments(
        as_ptr<const int64_t>(dst_ptr), as_ptr<const int64_t>(dst_pitch_ptr),
        as_ptr<const int64_t>(src_ptr), as_ptr<const int64_t>(src_pitch_ptr),
        as_ptr<const int64_t>(width_ptr), as_ptr<const int64_t>(height_ptr), count,
        as_stream(stream));
  }
  check_args(err, "memcpy_fragments");
}

// CUDA's status is returned, not raised: the caller decides which errors allow another way.
int memcpy_batch(std::uintptr_t dst_ptr, std::uintptr_t src_ptr, std::uintptr_t sizes_ptr,
                 int64_t count, int direction, std::uintptr_t stream) {
  cudaError_t err;
  {
    py::gil_scoped_release release;
    err = hicache::memcpy_batch(as_ptr<const int64_t>(dst_ptr), as_ptr<const int64_t>(src_ptr),
                                as_ptr<const int64_t>(sizes_ptr), count, direction,
                                as_stream(stream));
  }
  raise_argument_error(err);
  return static_cast<int>(err);
}

std::string error_name(int code) { return cudaGetErrorName(static_cast<cudaError_t>(code)); }

std::uintptr_t host_device_pointer(std::uintptr_t host_ptr) {
  void* device = nullptr;
  check(hicache::host_device_pointer(as_ptr<const void>(host_ptr), &device),
        "host_device_pointer (cudaPointerGetAttributes)");
  return reinterpret_cast<std::uintptr_t>(device);
}

// ---------------------------------------------------------------------------------------------
// Host-side helpers of the kernel package's Python (hicache_kernels.identity_cache, ._validate).

using hicache::Int64Array;

// Whether list/tuple `seq` holds exactly the objects whose addresses `ptrs` packs (native uintptr_t
// each): the identity check of a cached per-layer tensor list, without an int object per item.
bool same_items(py::handle seq, const py::bytes& ptrs) {
  PyObject* obj = seq.ptr();
  if (!PyList_Check(obj) && !PyTuple_Check(obj)) return false;
  char* data = nullptr;
  Py_ssize_t len = 0;
  if (PyBytes_AsStringAndSize(ptrs.ptr(), &data, &len) != 0) throw py::error_already_set();
  const Py_ssize_t n = Py_SIZE(obj);
  if (len != n * static_cast<Py_ssize_t>(sizeof(uintptr_t))) return false;
  PyObject** items = PyList_Check(obj) ? &PyList_GET_ITEM(obj, 0) : &PyTuple_GET_ITEM(obj, 0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    uintptr_t want;
    std::memcpy(&want, data + i * sizeof(uintptr_t), sizeof(uintptr_t));
    if (reinterpret_cast<uintptr_t>(items[i]) != want) return false;
  }
  return true;
}

// A transfer's CPU indices checked in one pass each (hicache_kernels._validate.index_values): the
// first fault as (side, kind, value) with side 0 = device / 1 = host, kind 1 = outside [0, n)
// (value: the lowest if below 0, else the highest) / 2 = a repeated destination slot (value: the
// smallest repeated), every range fault before any repeat; None when there is none.
py::object index_faults(const Int64Array& dev, int64_t n_dev, const Int64Array& host,
                        int64_t n_host, bool host_is_dst) {
  const Int64Array* sides[2] = {&dev, &host};
  const int64_t sizes[2] = {n_dev, n_host};
  for (int side = 0; side < 2; ++side) {
    const int64_t* p = sides[side]->data();
    const int64_t n = sides[side]->size();
    if (n == 0) continue;
    int64_t lo = p[0], hi = p[0];
    for (int64_t i = 1; i < n; ++i) {
      lo = std::min(lo, p[i]);
      hi = std::max(hi, p[i]);
    }
    if (lo < 0 || hi >= sizes[side]) return py::make_tuple(side, 1, lo < 0 ? lo : hi);
  }
  const int dst = host_is_dst ? 1 : 0;
  const int64_t n = sides[dst]->size();
  if (n < 2) return py::none();
  const int64_t* p = sides[dst]->data();
  bool ascending = true;  // the usual input (whole pages in order) needs no sort
  for (int64_t i = 1; i < n && ascending; ++i) ascending = p[i] > p[i - 1];
  if (ascending) return py::none();
  std::vector<int64_t> sorted(p, p + n);
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 1; i < n; ++i) {
    if (sorted[i] == sorted[i - 1]) return py::make_tuple(dst, 2, sorted[i]);
  }
  return py::none();
}

void bind_host_helpers(py::module_& m) {
  m.def("index_faults", &index_faults, py::arg("dev"), py::arg("n_dev"), py::arg("host"),
        py::arg("n_host"), py::arg("host_is_dst"),
        "A transfer's CPU indices: the first fault as (side, kind, value), or None.");
  m.def("same_items", &same_items, py::arg("seq"), py::arg("ptrs"),
        "Whether the list/tuple seq holds exactly the objects at the addresses packed in ptrs.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hicache-kernels CUDA extension (torch-free; static CUDA runtime)";
  m.def("build_info", &build_info, "Archs compiled in and the CUDA version built against.");
  m.def("runtime_version", &runtime_version, "Version of the statically linked CUDA runtime.");
  m.def("driver_version", &driver_version, "CUDA version the driver supports; 0 without a driver.");
  m.def("device_count", &device_count, "Number of CUDA devices; raises without a driver.");
  m.def("kernel_image_versions", &kernel_image_versions, py::arg("device"),
        "(binaryVersion, ptxVersion) of this build's code for the device, asked of the driver "
        "without changing the current device; raises RuntimeError when none fits.");
  m.def("bulk_image_versions", &bulk_image_versions, py::arg("device"),
        "kernel_image_versions() of the bulk-copy kernel: (binaryVersion, ptxVersion) of its code "
        "for the device. It copies only where both are >= 90 (code compiled for sm_90+); "
        "elsewhere it traps.");
  m.def("transfer", &transfer, py::arg("src_desc"), py::arg("src_table"), py::arg("dst_desc"),
        py::arg("dst_table"), py::arg("src_idx_ptr"), py::arg("dst_idx_ptr"), py::arg("n"),
        py::arg("layer_begin"), py::arg("layer_count"), py::arg("num_kv"), py::arg("num_chunks"),
        py::arg("chunk_bytes"), py::arg("align_bytes"), py::arg("num_blocks"),
        py::arg("warps_per_block"), py::arg("oob_count_ptr"), py::arg("stream"),
        py::arg("dst_host"),
        "Launch one chunk gather/scatter (csrc/transfer.h) on the current device. Descs are "
        "plan.Side.desc() 9-tuples (bytes); index and counter pointers are device addresses "
        "(oob_count_ptr 0 = none); dst_host: the destination is host memory (streaming stores; "
        "write-back stores for a device destination). ValueError naming a bad argument (checked "
        "before any CUDA call), RuntimeError for a CUDA error.");
  m.def("transfer_bulk", &transfer_bulk, py::arg("src_desc"), py::arg("src_table"),
        py::arg("dst_desc"), py::arg("dst_table"), py::arg("src_idx_ptr"), py::arg("dst_idx_ptr"),
        py::arg("n"), py::arg("layer_begin"), py::arg("layer_count"), py::arg("num_kv"),
        py::arg("num_chunks"), py::arg("chunk_bytes"), py::arg("align_bytes"),
        py::arg("num_blocks"), py::arg("warps_per_block"), py::arg("oob_count_ptr"),
        py::arg("stream"),
        "transfer() through the sm_90+ bulk-copy pipeline (csrc/transfer_bulk.cuh), same "
        "arguments. ValueError naming the argument, also when anything is not a multiple of 16 "
        "bytes (then use transfer()); RuntimeError with cudaErrorNotSupported below sm_90.");
  m.def("bulk_schedule", &bulk_schedule, py::arg("src_desc"), py::arg("src_table"),
        py::arg("dst_desc"), py::arg("dst_table"), py::arg("src_idx_ptr"), py::arg("dst_idx_ptr"),
        py::arg("n"), py::arg("layer_begin"), py::arg("layer_count"), py::arg("num_kv"),
        py::arg("num_chunks"), py::arg("chunk_bytes"), py::arg("align_bytes"),
        py::arg("num_blocks"), py::arg("warps_per_block"),
        "Host emulation of transfer_bulk by the kernel's own schedule code: index arrays and "
        "table sides' tables are HOST addresses. Returns {copies: [(block, round, slot, parity, "
        "smem_offset, src, dst, bytes)] in each CTA's issue order, oob_count, blocks, stages, "
        "stage_bytes}; copies nothing.");
  m.def("vector_bytes", &vector_bytes, py::arg("align_bytes"),
        "Vector width the transfer kernel uses when all addresses/strides are multiples of "
        "align_bytes: the largest of 16, 8, 4, 2, 1 dividing it (16 for 0).");
  m.def("memcpy_fragments", &memcpy_fragments, py::arg("dst_ptr"), py::arg("dst_pitch_ptr"),
        py::arg("src_ptr"), py::arg("src_pitch_ptr"), py::arg("width_ptr"), py::arg("height_ptr"),
        py::arg("count"), py::arg("stream"),
        "cudaMemcpyAsync / cudaMemcpy2DAsync per fragment; *_ptr are addresses of host int64 "
        "arrays of `count` entries (bytes). ValueError naming a bad fragment (all are checked "
        "before the first copy), RuntimeError for the first CUDA error.");
  m.def("memcpy_batch", &memcpy_batch, py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("sizes_ptr"),
        py::arg("count"), py::arg("direction"), py::arg("stream"),
        "All 1-D fragments in one cudaMemcpyBatchAsync (direction 0 = d2h, 1 = h2d) on a stream "
        "other than the legacy default one; *_ptr are addresses of host int64 arrays. ValueError "
        "naming a bad argument; otherwise returns CUDA's cudaError_t as an int (0 = success).");
  m.def("error_name", &error_name, py::arg("code"), "cudaGetErrorName of a cudaError_t value.");
  m.def("host_device_pointer", &host_device_pointer, py::arg("host_ptr"),
        "Device address of (any byte of) pinned host memory; raises for pageable memory.");
  bind_host_helpers(m);
}
