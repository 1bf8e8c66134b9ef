// Conversions between Python objects and the host core's plain C++ (host/bindings.cpp): token ids
// in, numpy int64 arrays out, and 1-byte-per-slot arrays the core keeps pointers into. Header only.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "py_arrays.h"

namespace hicache {

namespace py = pybind11;

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
inline void token_ids(py::handle tokens, int64_t n, std::vector<int64_t>* out) {
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

inline Int64Array to_array(const std::vector<int64_t>& v) {
  Int64Array out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(int64_t));
  return out;
}

// One byte per slot, writable when asked: numpy bool/uint8 arrays, never a converted copy (the core
// keeps the pointer).
inline uint8_t* byte_array(const py::buffer& buf, const char* name, bool writable, int64_t* size) {
  py::buffer_info info = buf.request(writable);
  if (info.ndim != 1 || info.itemsize != 1 || (info.shape[0] > 1 && info.strides[0] != 1)) {
    throw py::value_error(std::string(name) + ": expected a contiguous 1-D array of 1-byte items");
  }
  *size = info.shape[0];
  return static_cast<uint8_t*>(info.ptr);
}

}  // namespace hicache
