#include "radix_tree.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hicache {

namespace {

// splitmix64's finaliser: a cheap, well-mixed 64-bit hash step.
inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Tokens two sequences share from the start, up to n.
inline int64_t common_length(const int64_t* a, const int64_t* b, int64_t n) {
  if (std::memcmp(a, b, static_cast<size_t>(n) * sizeof(int64_t)) == 0) return n;
  return std::mismatch(a, a + n, b).first - a;
}

}  // namespace

RadixTree::RadixTree(int64_t page_size) : page_size_(page_size) {
  if (page_size < 1)
    throw std::invalid_argument("page_size: expected >= 1, got " + std::to_string(page_size));
  nodes_.emplace_back();  // the root: id 0, no key
  index_.emplace(0, 0);
}

void RadixTree::bind_slots(const SlotArrays& arrays) {
  slots_ = arrays;
  stamp_.assign(static_cast<size_t>(arrays.size / page_size_ + 1), 0);
  generation_ = 0;
}

const RadixTree::Node& RadixTree::node(int64_t id) const { return nodes_[ix(id)]; }

int32_t RadixTree::ix(int64_t id) const {
  auto it = index_.find(id);
  if (it == index_.end())
    throw std::out_of_range("node " + std::to_string(id) + " is not in the tree");
  return it->second;
}

int32_t RadixTree::new_node() {
  int32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
    nodes_[i] = Node();
  } else {
    i = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  nodes_[i].id = next_id_++;
  index_.emplace(nodes_[i].id, i);
  return i;
}

uint64_t RadixTree::page_hash(int32_t parent, const int64_t* page) const {
  uint64_t h = mix(static_cast<uint64_t>(parent));
  for (int64_t j = 0; j < page_size_; ++j) h = mix(h ^ static_cast<uint64_t>(page[j]));
  return h;
}

int32_t RadixTree::find_child(int32_t parent, const int64_t* page) const {
  auto range = edges_.equal_range(page_hash(parent, page));
  for (auto it = range.first; it != range.second; ++it) {
    const Node& c = nodes_[it->second];
    if (c.parent == parent && std::memcmp(c.key.data(), page, page_size_ * sizeof(int64_t)) == 0)
      return it->second;
  }
  return -1;
}

void RadixTree::link(int32_t parent, int32_t child) {
  nodes_[child].parent = parent;
  nodes_[parent].kids.push_back(child);
  edges_.emplace(page_hash(parent, nodes_[child].key.data()), child);
}

void RadixTree::unlink(int32_t parent, int32_t child) {
  auto range = edges_.equal_range(page_hash(parent, nodes_[child].key.data()));
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == child) {
      edges_.erase(it);
      break;
    }
  }
  auto& kids = nodes_[parent].kids;
  kids.erase(std::find(kids.begin(), kids.end(), child));
}

int64_t RadixTree::parent(int64_t id) const {
  int32_t p = node(id).parent;
  return p < 0 ? -1 : nodes_[p].id;
}

std::vector<int64_t> RadixTree::children(int64_t id) const {
  std::vector<int64_t> out;
  for (int32_t k : node(id).kids) out.push_back(nodes_[k].id);
  return out;
}

std::vector<int64_t> RadixTree::subtree(int64_t id) const {
  std::vector<int64_t> out;
  std::vector<int32_t> stack(node(id).kids);
  while (!stack.empty()) {
    int32_t k = stack.back();
    stack.pop_back();
    out.push_back(nodes_[k].id);
    stack.insert(stack.end(), nodes_[k].kids.begin(), nodes_[k].kids.end());
  }
  return out;
}

std::vector<int64_t> RadixTree::leaves(int kind) const {
  std::vector<int64_t> out;
  for (size_t i = 1; i < nodes_.size(); ++i) {
    const Node& x = nodes_[i];
    if (x.id < 0) continue;  // a free entry
    bool take;
    if (kind == 0) {
      take = x.has_value && std::none_of(x.kids.begin(), x.kids.end(),
                                         [&](int32_t k) { return nodes_[k].has_value; });
    } else {
      take = !x.has_value && x.kids.empty();
    }
    if (take) out.push_back(x.id);
  }
  return out;
}

void RadixTree::set_slots(int64_t id, const int64_t* slots, int64_t n) {
  Node& x = node(id);
  if (n != static_cast<int64_t>(x.key.size())) {
    throw std::invalid_argument("value: expected " + std::to_string(x.key.size()) +
                                " slots for node " + std::to_string(id) + ", got " +
                                std::to_string(n));
  }
  x.slots.assign(slots, slots + n);
  x.has_value = true;
}

void RadixTree::clear_slots(int64_t id) {
  Node& x = node(id);
  x.slots.clear();
  x.has_value = false;
}

void RadixTree::set_flag(int64_t id, int which, bool value) {
  Node& x = node(id);
  (which == 0 ? x.has_host : x.lost) = value;
}

bool RadixTree::flag(int64_t id, int which) const {
  const Node& x = node(id);
  return which == 0 ? x.has_host : x.lost;
}

int64_t RadixTree::meta(int64_t id, int which) const {
  const Node& x = node(id);
  switch (which) {
    case 0:
      return x.hit_count;
    case 1:
      return x.last_access;
    case 2:
      return x.creation;
    case 3:
      return x.priority;
    default:
      throw std::invalid_argument("meta: unknown field " + std::to_string(which));
  }
}

void RadixTree::set_meta(int64_t id, int which, int64_t value) {
  Node& x = node(id);
  switch (which) {
    case 0:
      x.hit_count = value;
      break;
    case 1:
      x.last_access = value;
      break;
    case 2:
      x.creation = value;
      break;
    case 3:
      x.priority = value;
      break;
    default:
      throw std::invalid_argument("meta: unknown field " + std::to_string(which));
  }
}

int64_t RadixTree::child_for(int64_t parent, const int64_t* page) const {
  const int32_t c = find_child(ix(parent), page);
  return c < 0 ? -1 : nodes_[c].id;
}

int64_t RadixTree::add_child(int64_t parent, const int64_t* key, int64_t n) {
  const int32_t p = ix(parent);
  if (n <= 0 || n % page_size_) {
    throw std::invalid_argument("key: expected a positive multiple of page_size " +
                                std::to_string(page_size_) + " tokens, got " + std::to_string(n));
  }
  if (find_child(p, key) >= 0) {
    throw std::invalid_argument("key: node " + std::to_string(parent) +
                                " already has a child starting with this page");
  }
  const int32_t k = new_node();
  Node& x = nodes_[k];
  x.key.assign(key, key + n);
  x.creation = x.last_access = ++clock_;
  link(p, k);
  return x.id;
}

std::vector<int64_t> RadixTree::remove(int64_t id) {
  if (id == 0) throw std::invalid_argument("node: the root cannot be removed");
  int32_t top = ix(id);
  unlink(nodes_[top].parent, top);
  std::vector<int64_t> removed;
  std::vector<int32_t> stack{top};
  while (!stack.empty()) {
    int32_t k = stack.back();
    stack.pop_back();
    Node& x = nodes_[k];
    for (int32_t c : x.kids) {
      auto range = edges_.equal_range(page_hash(k, nodes_[c].key.data()));
      for (auto it = range.first; it != range.second; ++it) {
        if (it->second == c) {
          edges_.erase(it);
          break;
        }
      }
      stack.push_back(c);
    }
    removed.push_back(x.id);
    index_.erase(x.id);
    x = Node();
    x.id = -1;
    free_.push_back(k);
  }
  return removed;
}

void RadixTree::walk(const int64_t* key, int64_t n, std::vector<int32_t>* path, int64_t* matched,
                     int64_t* cut) const {
  int32_t at = 0;
  int64_t pos = 0;
  *cut = 0;
  while (pos < n) {
    int32_t child = find_child(at, key + pos);
    if (child < 0) break;
    const std::vector<int64_t>& edge = nodes_[child].key;
    const int64_t m = static_cast<int64_t>(edge.size());
    path->push_back(child);
    const int64_t limit = std::min(m, n - pos);
    int64_t c = common_length(edge.data(), key + pos, limit);
    c -= c % page_size_;
    if (c < m) {  // the key leaves (or ends inside) this edge
      *matched = pos + c;
      *cut = c;
      return;
    }
    pos += m;
    at = child;
  }
  *matched = pos;
}

int32_t RadixTree::split(int32_t child, int64_t at, std::vector<Split>* splits) {
  const int32_t u = new_node();  // nodes_ is a deque: references taken below stay valid
  Node& c = nodes_[child];
  Node& up = nodes_[u];
  const int32_t p = c.parent;
  // The parent's edge for this first page now leads to the upper node, in the child's place.
  auto range = edges_.equal_range(page_hash(p, c.key.data()));
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == child) {
      it->second = u;
      break;
    }
  }
  *std::find(nodes_[p].kids.begin(), nodes_[p].kids.end(), child) = u;
  up.parent = p;
  up.key.assign(c.key.begin(), c.key.begin() + at);
  if (c.has_value) {
    up.slots.assign(c.slots.begin(), c.slots.begin() + at);
    c.slots.erase(c.slots.begin(), c.slots.begin() + at);
  }
  up.has_value = c.has_value;
  up.has_host = c.has_host;
  up.lost = c.lost;
  up.hit_count = c.hit_count;
  up.last_access = c.last_access;
  up.creation = c.creation;
  up.priority = c.priority;
  c.key.erase(c.key.begin(), c.key.begin() + at);
  link(u, child);
  splits->push_back(Split{c.id, up.id, at});
  return u;
}

void RadixTree::match(const int64_t* key, int64_t n, Touch touch, int64_t threshold,
                      MatchOut* out) {
  path_.clear();
  int64_t matched = 0, cut = 0;
  walk(key, n, &path_, &matched, &cut);
  if (cut) path_.back() = split(path_.back(), cut, &out->splits);
  out->device_slots.reserve(static_cast<size_t>(matched));  // no regrowth
  for (int32_t k : path_) {
    Node& x = nodes_[k];
    if (x.lost) break;  // its device KV is lost (failed load-back): no usable copy until released
    x.last_access = ++clock_;
    ++x.hit_count;
    if (touch == Touch::kSelective && x.hit_count >= threshold && x.has_value && !x.has_host) {
      out->backups.push_back(x.id);
    }
    const int64_t len = static_cast<int64_t>(x.key.size());
    if (x.has_value) {
      out->device_slots.insert(out->device_slots.end(), x.slots.begin(), x.slots.end());
      out->device_len += len;
      out->last_device = x.id;
    } else {
      out->host_len += len;
    }
    out->last_host = x.id;
  }
}

void RadixTree::take(const int64_t* s, int64_t n) {
  if (slots_.owned == nullptr) return;  // unbound: bindings.cpp refuses insert before bind_slots
  for (int64_t i = 0; i < n; ++i) slots_.owned[s[i]] = 1;
}

bool RadixTree::slots_ok(const int64_t* s, int64_t n) {
  if (n == 0) return true;
  const uint64_t size = static_cast<uint64_t>(slots_.size);
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<uint64_t>(s[i]) >= size) return false;  // negatives wrap to huge
  }
  const int64_t ps = page_size_;
  if (++generation_ == 0) {  // the stamps wrapped: start over
    std::fill(stamp_.begin(), stamp_.end(), 0);
    generation_ = 1;
  }
  for (int64_t i = 0; i < n; i += ps) {
    const int64_t first = s[i];
    if (first % ps) return false;
    for (int64_t j = 1; j < ps; ++j) {
      if (s[i + j] != first + j) return false;
    }
    uint32_t& stamp = stamp_[first / ps];
    if (stamp == generation_) return false;  // a page twice
    stamp = generation_;
    if (slots_.states[first] == 0) return false;  // not allocated (pools hand out whole pages)
  }
  for (int64_t i = 0; i < n; ++i) {
    if (slots_.owned[s[i]]) return false;
  }
  return true;
}

void RadixTree::insert(const int64_t* key, const int64_t* s, int64_t n, int64_t priority,
                       Touch touch, int64_t threshold, bool checked, InsertOut* out) {
  path_.clear();
  int64_t matched = 0, cut = 0;
  walk(key, n, &path_, &matched, &cut);
  int64_t dup = 0;
  for (int32_t k : path_) {  // device-resident nodes come first on a path
    const Node& x = nodes_[k];
    if (!x.has_value) break;
    dup += (cut && k == path_.back()) ? cut : static_cast<int64_t>(x.key.size());
  }
  out->dup = dup;
  if (!checked) {
    // Usually the caller passes the tree's own slots back for the cached part and fresh ones for
    // the rest; anything else goes to the caller's full check, which names the fault (or accepts
    // it).
    bool ok = slots_.states != nullptr;
    int64_t pos = 0;
    for (size_t i = 0; ok && i < path_.size() && pos < dup; ++i) {
      const Node& x = nodes_[path_[i]];
      const int64_t len = std::min<int64_t>(static_cast<int64_t>(x.key.size()), dup - pos);
      ok = std::memcmp(x.slots.data(), s + pos, static_cast<size_t>(len) * sizeof(int64_t)) == 0;
      pos += len;
    }
    ok = ok && slots_ok(s + dup, n - dup);
    if (!ok) {
      out->status = InsertStatus::kCheckSlots;
      int64_t left = dup;
      for (size_t i = 0; i < path_.size() && left > 0; ++i) {
        const Node& x = nodes_[path_[i]];
        const int64_t len = std::min<int64_t>(static_cast<int64_t>(x.key.size()), left);
        out->cached.insert(out->cached.end(), x.slots.begin(), x.slots.begin() + len);
        left -= len;
      }
      return;
    }
  }
  // Checked: from here on nothing fails.
  if (cut) path_.back() = split(path_.back(), cut, &out->splits);
  int32_t last = 0;
  int64_t pos = 0;
  for (int32_t k : path_) {
    Node& x = nodes_[k];
    const int64_t len = static_cast<int64_t>(x.key.size());
    if (!x.has_value) {  // host-only: revived with the caller's slots (its host copy stays valid)
      x.slots.assign(s + pos, s + pos + len);
      x.has_value = true;
      take(s + pos, len);
      out->revived.push_back(x.id);
    }
    if (priority > x.priority) x.priority = priority;
    x.last_access = ++clock_;
    ++x.hit_count;
    if (touch == Touch::kSelective && x.hit_count >= threshold && !x.has_host)
      out->backups.push_back(x.id);
    pos += len;
    last = k;
  }
  if (pos < n) {
    const int32_t k = new_node();
    Node& x = nodes_[k];
    x.key.assign(key + pos, key + n);
    x.slots.assign(s + pos, s + n);
    x.has_value = true;
    x.creation = x.last_access = ++clock_;
    x.hit_count = 1;
    x.priority = priority;
    link(last, k);
    take(s + pos, n - pos);
    out->new_node = x.id;
    if (touch == Touch::kWriteThrough) out->backups.push_back(x.id);
  }
}

}  // namespace hicache
