// Eviction candidates of one tier in policy order, kept as the tree changes
// (hicache.tree.candidates has the design): a lazy min-heap of (policy key, node id) over the
// compiled radix tree's counters. A node is pushed whenever it may have become a candidate and is
// queued at most once; a pop drops nodes that left the tree and puts back, with its new key, a node
// whose key grew since its push (it was hit). Exact for the built-in policies, whose keys never
// decrease over a node's life. Whether a popped node is a candidate now (locks, children) is the
// caller's check. Plain C++.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <queue>
#include <unordered_set>
#include <vector>

#include "radix_tree.h"

namespace hicache {

// The built-in policies of hicache.tree.policies, as keys of the tree's counters (smallest first).
enum class PolicyKey : int { kLru = 0, kLfu = 1, kSlru = 2, kFifo = 3, kPriority = 4 };

class CandidateHeap {
 public:
  using Key = std::array<int64_t, 4>;  // up to three policy fields, then the node id

  // `param`: SLRU's protected_hits (unused by the others).
  CandidateHeap(const RadixTree* tree, PolicyKey policy, int64_t param)
      : tree_(tree), policy_(policy), param_(param) {}

  Key key(int64_t id) const {
    const int64_t hits = tree_->meta(id, 0), access = tree_->meta(id, 1);
    switch (policy_) {
      case PolicyKey::kLru:
        return {access, id, 0, 0};
      case PolicyKey::kLfu:
        return {hits, access, id, 0};
      case PolicyKey::kSlru:
        return {hits >= param_ ? 1 : 0, access, id, 0};
      case PolicyKey::kFifo:
        return {tree_->meta(id, 2), id, 0, 0};
      case PolicyKey::kPriority:
        return {tree_->meta(id, 3), access, id, 0};
    }
    return {0, id, 0, 0};
  }

  // `id` may have become a candidate; a node not in the tree is not queued.
  void push(int64_t id) {
    if (!tree_->alive(id) || !queued_.insert(id).second) return;
    heap_.push(Entry{key(id), id});
  }

  // The least valuable queued node whose stored key is current (taken out), or -1 when none is
  // left.
  int64_t pop() {
    while (!heap_.empty()) {
      const Entry top = heap_.top();
      heap_.pop();
      queued_.erase(top.id);
      if (!tree_->alive(top.id)) continue;
      const Key now = key(top.id);
      if (now != top.key) {  // hit since its push: its place is further back
        queued_.insert(top.id);
        heap_.push(Entry{now, top.id});
        continue;
      }
      return top.id;
    }
    return -1;
  }

  int64_t size() const { return static_cast<int64_t>(heap_.size()); }
  bool queued(int64_t id) const { return queued_.count(id) != 0; }
  void clear() {
    heap_ = decltype(heap_)();
    queued_.clear();
  }

 private:
  struct Entry {
    Key key;
    int64_t id;
    bool operator>(const Entry& o) const { return key > o.key; }  // keys end in the id: never equal
  };

  const RadixTree* tree_;
  PolicyKey policy_;
  int64_t param_;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap_;
  std::unordered_set<int64_t> queued_;
};

}  // namespace hicache
