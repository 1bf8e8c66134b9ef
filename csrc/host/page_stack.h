// Page bookkeeping for hicache.pools: pop whole pages off a stack of free page ids and mark their
// slots, and move whole pages from one set of states to another (pushing them back when freed), in
// one call each instead of a handful of numpy operations. The arrays are numpy's, owned by the pool
// (bindings.cpp keeps them alive); plain C++, no Python.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace hicache {

struct PageStack {
  int64_t* stack = nullptr;   // free page ids; the top of the stack is the end
  uint8_t* states = nullptr;  // one state byte per slot
  uint8_t* ever = nullptr;    // one byte per slot: allocated at least once
  int64_t page_size = 1;
  int64_t num_pages = 0;
  // Per page: the call that last saw it (whole_pages' repeat check; never cleared, see `call`).
  std::vector<uint32_t> seen;
  uint32_t call = 0;

  // Pops `need` pages off a stack holding `top` (the top first, as stack[top-1], stack[top-2],
  // ...), sets their slots' state to `state` and `ever` to 1, and writes their slots in order to
  // `slots` (need * page_size entries).
  void pop(int64_t top, int64_t need, uint8_t state, int64_t* slots) const {
    for (int64_t i = 0; i < need; ++i) {
      const int64_t first = stack[top - 1 - i] * page_size;
      for (int64_t j = 0; j < page_size; ++j) {
        states[first + j] = state;
        ever[first + j] = 1;
        *slots++ = first + j;
      }
    }
  }

  // The pages of `slots` (n entries) into `pages` when they are whole pages, each page's slots
  // consecutive and in order, no page twice, every slot's state one of `sources` (bit s for state
  // s) and no page's first slot set in any of `owned` (owners hold whole pages); the page count,
  // or -1 when anything differs (nothing changed: the caller's general path names the fault).
  int64_t whole_pages(const int64_t* slots, int64_t n, uint32_t sources,
                      const uint8_t* const* owned, int64_t num_owned, int64_t* pages) {
    if (n <= 0 || n % page_size) return -1;
    if (++call == 0) {  // the counter wrapped: forget every earlier call
      std::fill(seen.begin(), seen.end(), 0u);
      call = 1;
    }
    const int64_t count = n / page_size;
    for (int64_t p = 0; p < count; ++p) {
      const int64_t* s = slots + p * page_size;
      const int64_t first = s[0];
      if (first < 0 || first % page_size || first / page_size >= num_pages) return -1;
      const int64_t page = first / page_size;
      if (seen[page] == call) return -1;
      seen[page] = call;
      for (int64_t j = 0; j < page_size; ++j) {
        if (s[j] != first + j || !((sources >> states[first + j]) & 1u)) return -1;
      }
      for (int64_t o = 0; o < num_owned; ++o) {
        if (owned[o][first]) return -1;
      }
      pages[p] = page;
    }
    return count;
  }

  // Sets every slot of `pages` to `state`; with `push` also puts the pages on the free stack above
  // `top` free pages, sorted so the next pop takes them in ascending order. The new top.
  int64_t set_pages(int64_t* pages, int64_t count, uint8_t state, bool push, int64_t top) {
    for (int64_t p = 0; p < count; ++p) {
      std::fill(states + pages[p] * page_size, states + (pages[p] + 1) * page_size, state);
    }
    if (!push) return top;
    std::sort(pages, pages + count);
    for (int64_t p = 0; p < count; ++p) stack[top + p] = pages[count - 1 - p];
    return top + count;
  }
};

}  // namespace hicache
