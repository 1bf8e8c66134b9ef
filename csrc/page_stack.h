// Page allocation for hicache.pools: pop whole pages off a stack of free page ids and mark their
// slots, in one call instead of a handful of numpy operations. The arrays are numpy's, owned by
// the pool (bindings.cpp keeps them alive); plain C++, no Python.
#pragma once

#include <cstdint>

namespace hicache {

struct PageStack {
  const int64_t* stack = nullptr;  // free page ids; the top of the stack is the end
  uint8_t* states = nullptr;       // one state byte per slot
  uint8_t* ever = nullptr;         // one byte per slot: allocated at least once
  int64_t page_size = 1;

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
};

}  // namespace hicache
