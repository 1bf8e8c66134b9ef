// The only file that knows about Python. Arguments are plain integers (device pointers, sizes,
// strides, stream handles), so this module never includes or links torch and one build serves any
// torch version.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "build_facts.h"
#include "candidate_heap.h"
#include "copy_engine.h"
#include "page_checksum.h"
#include "page_stack.h"
#include "radix_tree.h"
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
  check_args(
      hicache::bulk_schedule(src, src_table, dst, dst_table, as_ptr<const int64_t>(src_idx_ptr),
                             as_ptr<const int64_t>(dst_idx_ptr), n, layer_begin, layer_count,
                             num_kv, num_chunks, chunk_bytes, align_bytes, num_blocks,
                             warps_per_block, &copies, &oob, &blocks),
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
  d["stages"] = hicache::bulk_ring_stages();
  d["stage_bytes"] = hicache::bulk_stage_bytes();
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
// The radix tree core (radix_tree.h): Python sequences of token ids in, numpy int64 arrays out.

using Int64Array = py::array_t<int64_t, py::array::c_style>;

// An exact int's value, read in place when it is a one-digit ("compact") int, as token ids are: the
// per-token cost of converting a prompt. -1 with an exception set on overflow, as
// PyLong_AsLongLong.
inline long long compact_int(PyObject* item) {
#if PY_VERSION_HEX >= 0x030C0000
  if (PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(item))) {
    return PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(item));
  }
#elif !defined(Py_LIMITED_API)
  const Py_ssize_t size = Py_SIZE(item);
  if (size >= -1 && size <= 1) {
    return size * static_cast<long long>(reinterpret_cast<PyLongObject*>(item)->ob_digit[0]);
  }
#endif
  return PyLong_AsLongLong(item);
}

// Token ids as int64: a list or tuple of ints (the usual call, converted in place), or a 1-D
// integer numpy array. First n ids only (the caller cuts to whole pages).
void token_ids(py::handle tokens, int64_t n, std::vector<int64_t>* out) {
  out->resize(static_cast<size_t>(n));
  int64_t* dst = out->data();
  PyObject* obj = tokens.ptr();
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    if (Py_SIZE(obj) < n)
      throw py::value_error("tokens: fewer than " + std::to_string(n) + " token ids");
    PyObject** items = PyList_Check(obj) ? &PyList_GET_ITEM(obj, 0) : &PyTuple_GET_ITEM(obj, 0);
    constexpr int64_t kAhead =
        16;  // a prompt's int objects are scattered: fetch ahead of the reads
    for (int64_t i = 0; i < std::min(n, kAhead); ++i) __builtin_prefetch(items[i]);
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) __builtin_prefetch(items[i + kAhead]);
      PyObject* item = items[i];
      long long v;
      if (PyLong_CheckExact(item)) {
        v = compact_int(item);
      } else {
        PyObject* index = PyNumber_Index(item);  // numpy integers, bool; refuses floats
        if (index == nullptr) {
          PyErr_Clear();
          throw py::type_error("tokens: expected integer token ids, got " +
                               std::string(Py_TYPE(item)->tp_name) + " at position " +
                               std::to_string(i));
        }
        v = PyLong_AsLongLong(index);
        Py_DECREF(index);
      }
      if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        throw py::value_error("tokens: token id at position " + std::to_string(i) +
                              " does not fit in int64");
      }
      dst[i] = v;
    }
    return;
  }
  py::array arr = py::reinterpret_borrow<py::array>(tokens);
  if (arr.ndim() != 1 || (arr.dtype().kind() != 'i' && arr.dtype().kind() != 'u')) {
    throw py::type_error("tokens: expected a list/tuple of ints or a 1-D integer array");
  }
  if (arr.shape(0) < n)
    throw py::value_error("tokens: fewer than " + std::to_string(n) + " token ids");
  auto ids = arr.cast<Int64Array>();  // a copy only when the dtype differs
  std::memcpy(dst, ids.data(), static_cast<size_t>(n) * sizeof(int64_t));
}

Int64Array to_array(const std::vector<int64_t>& v) {
  Int64Array out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(int64_t));
  return out;
}

py::list splits_list(const std::vector<hicache::Split>& splits) {
  py::list out;
  for (const auto& s : splits) out.append(py::make_tuple(s.lower, s.upper, s.at));
  return out;
}

// One byte per slot, writable when asked: numpy bool/uint8 arrays, never a converted copy (the core
// keeps the pointer).
uint8_t* byte_array(const py::buffer& buf, const char* name, bool writable, int64_t* size) {
  py::buffer_info info = buf.request(writable);
  if (info.ndim != 1 || info.itemsize != 1 || (info.shape[0] > 1 && info.strides[0] != 1)) {
    throw py::value_error(std::string(name) + ": expected a contiguous 1-D array of 1-byte items");
  }
  *size = info.shape[0];
  return static_cast<uint8_t*>(info.ptr);
}

class PyRadixTree {
 public:
  explicit PyRadixTree(int64_t page_size) : tree_(page_size) {}

  void bind_slots(const py::buffer& states, const py::buffer& owned) {
    hicache::SlotArrays a;
    int64_t n_owned = 0;
    a.states = byte_array(states, "states", false, &a.size);
    a.owned = byte_array(owned, "owned", true, &n_owned);
    if (n_owned != a.size) throw py::value_error("owned: expected one entry per slot of states");
    tree_.bind_slots(a);
    states_ = states;  // the arrays outlive the pointers the core keeps
    owned_ = owned;
  }

  py::tuple match(py::handle tokens, int64_t n, int touch, int64_t threshold) {
    token_ids(tokens, n, &key_);
    hicache::MatchOut out;
    tree_.match(key_.data(), n, static_cast<hicache::Touch>(touch), threshold, &out);
    return py::make_tuple(to_array(out.device_slots), out.device_len, out.host_len, out.last_device,
                          out.last_host, splits_list(out.splits), py::cast(out.backups));
  }

  py::tuple insert(py::handle tokens, const Int64Array& slots, int64_t priority, int touch,
                   int64_t threshold, bool checked) {
    if (!tree_.slots_bound()) throw std::runtime_error("insert: bind_slots was not called");
    const int64_t n = slots.shape(0);
    token_ids(tokens, n, &key_);
    hicache::InsertOut out;
    tree_.insert(key_.data(), slots.data(), n, priority, static_cast<hicache::Touch>(touch),
                 threshold, checked, &out);
    py::object cached = py::none();
    if (out.status != hicache::InsertStatus::kOk) cached = to_array(out.cached);
    return py::make_tuple(static_cast<int>(out.status), out.dup, cached, splits_list(out.splits),
                          py::cast(out.backups), out.new_node, py::cast(out.revived));
  }

  py::object slots(int64_t id) const {
    if (!tree_.has_value(id)) return py::none();
    return to_array(tree_.slots(id));
  }

  void set_slots(int64_t id, py::object value) {
    if (value.is_none()) {
      tree_.clear_slots(id);
      return;
    }
    auto v = value.cast<Int64Array>();
    tree_.set_slots(id, v.data(), v.shape(0));
  }

  py::tuple key(int64_t id) const {
    const auto& k = tree_.key(id);
    py::tuple out(k.size());
    for (size_t i = 0; i < k.size(); ++i) PyTuple_SET_ITEM(out.ptr(), i, PyLong_FromLongLong(k[i]));
    return out;
  }

  int64_t child_for(int64_t parent, py::handle tokens) {
    token_ids(tokens, tree_.page_size(), &key_);
    return tree_.child_for(parent, key_.data());
  }

  int64_t add_child(int64_t parent, py::handle tokens) {
    const int64_t n = static_cast<int64_t>(py::len(tokens));
    token_ids(tokens, n, &key_);
    return tree_.add_child(parent, key_.data(), n);
  }

  hicache::RadixTree& core() { return tree_; }

 private:
  hicache::RadixTree tree_;
  std::vector<int64_t> key_;  // scratch
  py::object states_, owned_;
};

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

// checksum_words over a buffer of whole 64-bit words, without the GIL.
uint64_t checksum_words(const py::buffer& data, uint64_t first, uint64_t sum) {
  py::buffer_info info = data.request();
  const int64_t nbytes = info.size * info.itemsize;
  if (info.ndim != 1 || (info.shape[0] > 1 && info.strides[0] != info.itemsize) || nbytes % 8) {
    throw py::value_error("data: expected a contiguous 1-D buffer of whole 8-byte words");
  }
  py::gil_scoped_release release;
  return hicache::checksum_words(static_cast<const unsigned char*>(info.ptr), nbytes / 8, first,
                                 sum);
}

// Reads len(buffers[i]) bytes into each buffer from fd at offset (in order, chunk by chunk) and
// adds each chunk to the checksum right after it lands (still in the CPU cache); every buffer a
// whole number of 8-byte words. Returns (bytes read, sum): fewer bytes at end of file. No GIL while
// reading.
py::tuple pread_checksum(int fd, int64_t offset, const py::list& buffers, uint64_t first,
                         uint64_t sum, int64_t chunk) {
  if (chunk <= 0 || chunk % 8) throw py::value_error("chunk: expected a positive multiple of 8");
  std::vector<std::pair<unsigned char*, int64_t>> bufs;
  for (py::handle h : buffers) {
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(h).request(true);
    const int64_t n = info.size * info.itemsize;
    if (info.ndim != 1 || (info.shape[0] > 1 && info.strides[0] != info.itemsize) || n % 8) {
      throw py::value_error("buffers: expected contiguous writable buffers of whole 8-byte words");
    }
    bufs.emplace_back(static_cast<unsigned char*>(info.ptr), n);
  }
  int64_t total = 0;
  int err = 0;
  {
    py::gil_scoped_release release;
    uint64_t word = first;
    bool eof = false;
    for (const auto& [ptr, n] : bufs) {
      for (int64_t done = 0; done < n && !err && !eof;) {
        const int64_t want = std::min(chunk, n - done);
        int64_t got = 0;
        while (got < want) {
          const ssize_t r =
              ::pread(fd, ptr + done + got, static_cast<size_t>(want - got), offset + total + got);
          if (r < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
          }
          if (r == 0) break;  // end of file
          got += r;
        }
        sum = hicache::checksum_words(ptr + done, got / 8, word, sum);
        word += got / 8;
        total += got;
        done += got;
        eof = got < want;
      }
      if (err || eof) break;
    }
  }
  if (err) throw std::system_error(err, std::generic_category(), "pread");
  return py::make_tuple(total, sum);
}

class PyPageStack {
 public:
  PyPageStack(const py::buffer& stack, const py::buffer& states, const py::buffer& ever,
              int64_t page_size) {
    py::buffer_info info = stack.request(true);
    if (info.ndim != 1 || info.itemsize != 8 || (info.format != "l" && info.format != "q") ||
        (info.shape[0] > 1 && info.strides[0] != 8)) {
      throw py::value_error("stack: expected a contiguous 1-D int64 array");
    }
    if (page_size < 1) throw py::value_error("page_size: expected >= 1");
    int64_t n_states = 0, n_ever = 0;
    p_.stack = static_cast<int64_t*>(info.ptr);
    p_.states = byte_array(states, "states", true, &n_states);
    p_.ever = byte_array(ever, "ever", true, &n_ever);
    p_.page_size = page_size;
    p_.num_pages = info.shape[0];
    p_.seen.assign(static_cast<size_t>(p_.num_pages), 0u);
    if (n_states < p_.num_pages * page_size || n_ever != n_states) {
      throw py::value_error("states, ever: expected page_size entries per page of stack");
    }
    keep_ = py::make_tuple(stack, states, ever);
  }

  Int64Array pop(int64_t top, int64_t need, int state) const {
    if (top < 0 || top > p_.num_pages || need < 0 || need > top || state < 0 || state > 255) {
      throw py::value_error("pop: top/need/state out of range");
    }
    Int64Array out(static_cast<py::ssize_t>(need * p_.page_size));
    p_.pop(top, need, static_cast<uint8_t>(state), out.mutable_data());
    return out;
  }

  // The slots an owner holds, one byte per slot (see PageStack::whole_pages); replaces the last
  // set.
  void set_owned(const py::list& arrays) {
    std::vector<const uint8_t*> ptrs;
    for (py::handle a : arrays) {
      int64_t n = 0;
      ptrs.push_back(byte_array(py::reinterpret_borrow<py::buffer>(a), "owned", false, &n));
      if (n != p_.num_pages * p_.page_size)
        throw py::value_error("owned: expected one entry per slot");
    }
    owned_ = std::move(ptrs);
    owned_keep_ = py::tuple(arrays);
  }

  // Moves whole pages given in order from one of `sources` (bit s for state s) to `target`, all or
  // nothing; with `push` the pages go on the free stack above `top`. The new top (`top` without
  // push), or -1 with nothing changed when the slots are anything else, one is in another state, or
  // (`check_owned`) an owner holds one: the caller's general path then decides and names the fault.
  int64_t transition(const py::buffer& slots, uint32_t sources, int target, bool push, int64_t top,
                     bool check_owned) {
    if (target < 0 || target > 255 || (push && (sources & 1u)) || top < 0 || top > p_.num_pages) {
      throw py::value_error("transition: target/top out of range, or a push from FREE");
    }
    py::buffer_info info = slots.request();
    if (info.ndim != 1 || info.itemsize != 8 || (info.format != "l" && info.format != "q") ||
        (info.shape[0] > 1 && info.strides[0] != 8)) {
      return -1;
    }
    const int64_t n = info.shape[0];
    pages_.resize(static_cast<size_t>(n / p_.page_size + 1));
    const int64_t count =
        p_.whole_pages(static_cast<const int64_t*>(info.ptr), n, sources, owned_.data(),
                       check_owned ? static_cast<int64_t>(owned_.size()) : 0, pages_.data());
    if (count < 0) return -1;
    if (push && top + count > p_.num_pages)
      throw std::logic_error("transition: free stack overflow");
    return p_.set_pages(pages_.data(), count, static_cast<uint8_t>(target), push, top);
  }

 private:
  hicache::PageStack p_;
  std::vector<int64_t> pages_;  // scratch: one call's pages
  std::vector<const uint8_t*> owned_;
  py::tuple keep_;        // the arrays outlive the pointers
  py::tuple owned_keep_;  // likewise the owners' arrays
};

// One tier's eviction candidates over a PyRadixTree's counters (hicache.candidates); keeps the
// tree alive.
class PyCandidateHeap {
 public:
  PyCandidateHeap(py::object tree, int policy, int64_t param) : keep_(tree) {
    if (policy < 0 || policy > 4)
      throw py::value_error("policy: expected 0..4 (lru, lfu, slru, fifo, priority)");
    heap_ = std::make_unique<hicache::CandidateHeap>(
        &tree.cast<PyRadixTree&>().core(), static_cast<hicache::PolicyKey>(policy), param);
  }
  hicache::CandidateHeap& heap() { return *heap_; }

 private:
  py::object keep_;
  std::unique_ptr<hicache::CandidateHeap> heap_;
};

void bind_radix_tree(py::module_& m) {
  m.def("checksum_words", &checksum_words, py::arg("data"), py::arg("first"), py::arg("sum"),
        "The file backend's page checksum over whole 8-byte words (hicache.storage.checksum).");
  m.def("pread_checksum", &pread_checksum, py::arg("fd"), py::arg("offset"), py::arg("buffers"),
        py::arg("first"), py::arg("sum"), py::arg("chunk"),
        "Read a file range into buffers chunk by chunk, adding each chunk to the page checksum.");
  m.def("index_faults", &index_faults, py::arg("dev"), py::arg("n_dev"), py::arg("host"),
        py::arg("n_host"), py::arg("host_is_dst"),
        "A transfer's CPU indices: the first fault as (side, kind, value), or None.");
  m.def("same_items", &same_items, py::arg("seq"), py::arg("ptrs"),
        "Whether the list/tuple seq holds exactly the objects at the addresses packed in ptrs.");
  py::class_<PyPageStack>(m, "PageStack",
                          "Page allocation over a pool's numpy arrays (see hicache.pools).")
      .def(py::init<const py::buffer&, const py::buffer&, const py::buffer&, int64_t>(),
           py::arg("stack"), py::arg("states"), py::arg("ever"), py::arg("page_size"))
      .def("pop", &PyPageStack::pop, py::arg("top"), py::arg("need"), py::arg("state"),
           "Pop need pages off the top pages of stack (top first), mark their slots, return the "
           "slots.")
      .def("set_owned", &PyPageStack::set_owned, py::arg("arrays"),
           "The owners' slot flags (1-byte arrays, one entry per slot) transition checks.")
      .def("transition", &PyPageStack::transition, py::arg("slots"), py::arg("sources"),
           py::arg("target"), py::arg("push"), py::arg("top"), py::arg("check_owned"),
           "Move whole pages in order between states (see hicache.paged_slots); the new top, or -1 "
           "with nothing changed for anything the general path must decide.");

  py::class_<PyCandidateHeap>(
      m, "CandidateHeap",
      "One tier's eviction candidates in policy order (see hicache.candidates).")
      .def(py::init<py::object, int, int64_t>(), py::arg("tree"), py::arg("policy"),
           py::arg("param"))
      .def(
          "push", [](PyCandidateHeap& h, int64_t id) { h.heap().push(id); }, py::arg("id"))
      .def("pop", [](PyCandidateHeap& h) { return h.heap().pop(); })
      .def(
          "key",
          [](PyCandidateHeap& h, int64_t id) {
            auto k = h.heap().key(id);
            return py::make_tuple(k[0], k[1], k[2], k[3]);
          },
          py::arg("id"))
      .def("__len__", [](PyCandidateHeap& h) { return h.heap().size(); })
      .def(
          "__contains__", [](PyCandidateHeap& h, int64_t id) { return h.heap().queued(id); },
          py::arg("id"))
      .def("clear", [](PyCandidateHeap& h) { h.heap().clear(); });
  using hicache::RadixTree;
  py::class_<PyRadixTree>(
      m, "RadixTree",
      "The compiled radix-tree core of hicache.HiRadixCache (see hicache.tree_core).")
      .def(py::init<int64_t>(), py::arg("page_size"))
      .def("bind_slots", &PyRadixTree::bind_slots, py::arg("states"), py::arg("owned"),
           "The device pool's slot states (uint8, 0 = free) and the tree's ownership bytes (bool, "
           "written); kept by reference.")
      .def("match", &PyRadixTree::match, py::arg("tokens"), py::arg("n"), py::arg("touch"),
           py::arg("threshold"),
           "(device_slots, device_len, host_len, last_device, last_host, splits, backups)")
      .def("insert", &PyRadixTree::insert, py::arg("tokens"), py::arg("slots"), py::arg("priority"),
           py::arg("touch"), py::arg("threshold"), py::arg("checked"),
           "(status, dup, cached, splits, backups, new_node, revived); status 1: the slots need "
           "the full check (nothing changed; cached = the tree's slots of the first dup tokens)")
      .def("slots", &PyRadixTree::slots, py::arg("id"))
      .def("set_slots", &PyRadixTree::set_slots, py::arg("id"), py::arg("value"))
      .def("key", &PyRadixTree::key, py::arg("id"))
      .def("child_for", &PyRadixTree::child_for, py::arg("parent"), py::arg("tokens"),
           "id of parent's child whose key starts with the first page of tokens, or -1")
      .def("add_child", &PyRadixTree::add_child, py::arg("parent"), py::arg("tokens"),
           "a new child of parent keyed by tokens, without device slots; returns its id")
      .def(
          "alive", [](PyRadixTree& t, int64_t id) { return t.core().alive(id); }, py::arg("id"))
      .def(
          "parent", [](PyRadixTree& t, int64_t id) { return t.core().parent(id); }, py::arg("id"))
      .def(
          "length", [](PyRadixTree& t, int64_t id) { return t.core().length(id); }, py::arg("id"))
      .def(
          "children", [](PyRadixTree& t, int64_t id) { return t.core().children(id); },
          py::arg("id"))
      .def(
          "subtree", [](PyRadixTree& t, int64_t id) { return t.core().subtree(id); }, py::arg("id"))
      .def(
          "leaves", [](PyRadixTree& t, int kind) { return t.core().leaves(kind); }, py::arg("kind"),
          "ids of device leaves (kind 0: device slots, no child has any) or host leaves (kind 1: "
          "no "
          "device slots, no children)")
      .def(
          "has_value", [](PyRadixTree& t, int64_t id) { return t.core().has_value(id); },
          py::arg("id"))
      .def(
          "flag", [](PyRadixTree& t, int64_t id, int w) { return t.core().flag(id, w); },
          py::arg("id"), py::arg("which"))
      .def(
          "set_flag",
          [](PyRadixTree& t, int64_t id, int w, bool v) { t.core().set_flag(id, w, v); },
          py::arg("id"), py::arg("which"), py::arg("value"))
      .def(
          "meta", [](PyRadixTree& t, int64_t id, int w) { return t.core().meta(id, w); },
          py::arg("id"), py::arg("which"))
      .def(
          "set_meta",
          [](PyRadixTree& t, int64_t id, int w, int64_t v) { t.core().set_meta(id, w, v); },
          py::arg("id"), py::arg("which"), py::arg("value"))
      .def(
          "remove", [](PyRadixTree& t, int64_t id) { return t.core().remove(id); }, py::arg("id"))
      .def_property_readonly("clock", [](PyRadixTree& t) { return t.core().clock(); })
      .def_property_readonly("num_nodes", [](PyRadixTree& t) { return t.core().num_nodes(); })
      .def_property_readonly("page_size", [](PyRadixTree& t) { return t.core().page_size(); });
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
  bind_radix_tree(m);
}
