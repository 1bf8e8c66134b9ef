// hicache._core: the cache layer's compiled host core, built with the host C++ compiler alone (no
// CUDA, no torch) into every build, HICACHE_SKIP_CUDA=1 included. The radix tree (radix_tree.h),
// its eviction candidates (candidate_heap.h), the pools' page stack (page_stack.h) and the file
// backend's page checksum (page_checksum.h), each over numpy arrays and Python token sequences.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "candidate_heap.h"
#include "page_checksum.h"
#include "page_stack.h"
#include "py_convert.h"
#include "radix_tree.h"

namespace py = pybind11;

namespace {

using hicache::byte_array;
using hicache::Int64Array;
using hicache::to_array;
using hicache::token_ids;

py::list splits_list(const std::vector<hicache::Split>& splits) {
  py::list out;
  for (const auto& s : splits) out.append(py::make_tuple(s.lower, s.upper, s.at));
  return out;
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

// One tier's eviction candidates over a PyRadixTree's counters (hicache.tree.candidates); keeps the
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

void bind_checksum(py::module_& m) {
  m.def("checksum_words", &checksum_words, py::arg("data"), py::arg("first"), py::arg("sum"),
        "The file backend's page checksum over whole 8-byte words (hicache.storage.checksum).");
  m.def("pread_checksum", &pread_checksum, py::arg("fd"), py::arg("offset"), py::arg("buffers"),
        py::arg("first"), py::arg("sum"), py::arg("chunk"),
        "Read a file range into buffers chunk by chunk, adding each chunk to the page checksum.");
}

void bind_page_stack(py::module_& m) {
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
           "Move whole pages in order between states (see hicache.pools.paged_slots); the new top, "
           "or -1 "
           "with nothing changed for anything the general path must decide.");
}

void bind_candidate_heap(py::module_& m) {
  py::class_<PyCandidateHeap>(
      m, "CandidateHeap",
      "One tier's eviction candidates in policy order (see hicache.tree.candidates).")
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
}

void bind_radix_tree(py::module_& m) {
  py::class_<PyRadixTree>(
      m, "RadixTree",
      "The compiled radix-tree core of hicache.HiRadixCache (see hicache.tree.core).")
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

PYBIND11_MODULE(_core, m) {
  m.doc() = "hicache's compiled host core: radix tree, eviction candidates, page stack, checksums";
  bind_radix_tree(m);
  bind_candidate_heap(m);
  bind_page_stack(m);
  bind_checksum(m);
}
