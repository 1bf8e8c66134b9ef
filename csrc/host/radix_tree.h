// The compiled core of hicache's radix tree (python/hicache/tree/core.py wraps it): token keys,
// topology, device slots and access counters of every node, and the two hot calls of a scheduler
// step, match and insert, each one call with no Python in between. Plain C++17: no Python, no
// torch, no CUDA; bindings.cpp converts the arguments.
//
// Semantics are those of the Python tree (python/hicache/cache/radix_cache.py, the reference it is
// tested against): page-aligned keys, an edge leaves a node by its first page, a split keeps the
// lower node's id, the clock ticks once per touched node, ids are never reused.
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

namespace hicache {

// The slot state arrays the insert check reads and writes (numpy arrays owned by the pools, bound
// once): one byte per device slot each.
struct SlotArrays {
  const uint8_t* states = nullptr;  // the device pool's slot states, 0 = free
  uint8_t* owned = nullptr;         // 1 where the tree owns the slot
  int64_t size = 0;                 // slots in the pool
};

struct Split {
  int64_t lower;  // the node that was cut (keeps its id, loses its first `at` tokens)
  int64_t upper;  // the new node holding those tokens
  int64_t at;
};

struct MatchOut {
  std::vector<int64_t> device_slots;  // the device-resident prefix's slots
  int64_t device_len = 0, host_len = 0;
  int64_t last_device = 0, last_host = 0;  // ids (0 = root)
  std::vector<Split> splits;
  std::vector<int64_t> backups;  // ids write_through_selective wants backed up
};

enum class InsertStatus : int { kOk = 0, kCheckSlots = 1 };

struct InsertOut {
  InsertStatus status = InsertStatus::kOk;
  int64_t dup = 0;
  std::vector<int64_t> cached;  // kCheckSlots: the tree's slots of key[:dup] (for the full check)
  std::vector<Split> splits;
  std::vector<int64_t> backups;  // ids to back up, in order (selective hits, then the new node)
  int64_t new_node = -1;
  std::vector<int64_t> revived;  // host-only nodes on the path that got the caller's device slots
};

// Write policies as the insert/match hot path sees them.
enum class Touch : int { kPlain = 0, kSelective = 1, kWriteThrough = 2 };

class RadixTree {
 public:
  explicit RadixTree(int64_t page_size);

  int64_t page_size() const { return page_size_; }
  int64_t clock() const { return clock_; }
  int64_t num_nodes() const { return static_cast<int64_t>(index_.size()); }  // root included

  void bind_slots(const SlotArrays& arrays);
  bool slots_bound() const { return slots_.states != nullptr; }

  // match_prefix: key has n tokens (a multiple of the page size).
  void match(const int64_t* key, int64_t n, Touch touch, int64_t threshold, MatchOut* out);
  // insert: key and slots have n entries each (checked by the caller).
  void insert(const int64_t* key, const int64_t* slots, int64_t n, int64_t priority, Touch touch,
              int64_t threshold, bool checked, InsertOut* out);

  // Node access by id; each throws std::out_of_range for an id not in the tree.
  bool alive(int64_t id) const { return index_.count(id) != 0; }
  int64_t parent(int64_t id) const;  // -1 for the root
  const std::vector<int64_t>& key(int64_t id) const { return node(id).key; }
  int64_t length(int64_t id) const { return static_cast<int64_t>(node(id).key.size()); }
  std::vector<int64_t> children(int64_t id) const;
  std::vector<int64_t> subtree(int64_t id) const;  // below id, each node before its descendants
  // Eviction candidates, root excluded: kind 0, nodes with device slots none of whose children has
  // any; kind 1, nodes without device slots and without children.
  std::vector<int64_t> leaves(int kind) const;
  bool has_value(int64_t id) const { return node(id).has_value; }
  const std::vector<int64_t>& slots(int64_t id) const { return node(id).slots; }
  void set_slots(int64_t id, const int64_t* slots, int64_t n);  // n == length(id)
  void clear_slots(int64_t id);
  void set_flag(int64_t id, int which, bool value);  // 0 = has_host, 1 = lost
  bool flag(int64_t id, int which) const;
  int64_t meta(int64_t id, int which) const;  // 0 hit_count, 1 last_access, 2 creation, 3 priority
  void set_meta(int64_t id, int which, int64_t value);
  // The child of `parent` whose key starts with `page` (page_size tokens), or -1.
  int64_t child_for(int64_t parent, const int64_t* page) const;
  // A new child of `parent` with key[0:n) (n a multiple of the page size, its first page not a key
  // of another child) and no device slots, created and last accessed now; returns its id.
  int64_t add_child(int64_t parent, const int64_t* key, int64_t n);
  // Remove id and its subtree; returns the removed ids (id first). The root cannot be removed.
  std::vector<int64_t> remove(int64_t id);

 private:
  struct Node {
    int64_t id = 0;
    int32_t parent = -1;  // index
    std::vector<int64_t> key;
    std::vector<int64_t> slots;  // device slots, valid when has_value
    std::vector<int32_t> kids;   // indices
    bool has_value = false, has_host = false, lost = false;
    int64_t hit_count = 0, last_access = 0, creation = 0, priority = 0;
  };

  const Node& node(int64_t id) const;
  Node& node(int64_t id) {
    return const_cast<Node&>(static_cast<const RadixTree*>(this)->node(id));
  }
  int32_t ix(int64_t id) const;
  int32_t new_node();
  uint64_t page_hash(int32_t parent, const int64_t* page) const;
  int32_t find_child(int32_t parent, const int64_t* page) const;
  void link(int32_t parent, int32_t child);
  void unlink(int32_t parent, int32_t child);
  // Walk from the root: path (indices), matched tokens, cut (> 0: key leaves path.back() there).
  void walk(const int64_t* key, int64_t n, std::vector<int32_t>* path, int64_t* matched,
            int64_t* cut) const;
  int32_t split(int32_t child, int64_t at, std::vector<Split>* splits);
  void take(const int64_t* s, int64_t n);
  bool slots_ok(const int64_t* s, int64_t n);

  int64_t page_size_;
  int64_t next_id_ = 1;
  int64_t clock_ = 0;
  std::deque<Node> nodes_;  // a deque: references stay valid when a node is added
  std::vector<int32_t> free_;
  std::unordered_map<int64_t, int32_t> index_;  // id -> index
  std::unordered_multimap<uint64_t, int32_t>
      edges_;  // hash(parent index, first page) -> child index
  SlotArrays slots_;
  std::vector<uint32_t> stamp_;  // per device page: the insert check's repeat detection
  uint32_t generation_ = 0;
  std::vector<int32_t> path_;  // scratch
};

}  // namespace hicache
