// The address formula of transfer.h, once, for every kernel and for host emulation: the two side
// functors and the unit -> (index, kv, layer, chunk) decomposition. __host__ __device__ so that the
// bulk kernel's stage schedule can be run on the CPU by the same code (transfer_bulk.cu); on the
// host, a table side's `base` and the index arrays are host pointers.
#pragma once

#include <cstdint>

#include "transfer.h"

namespace hicache {

// A read-only int64 through the non-coherent cache on the device; a plain load on the host.
__host__ __device__ __forceinline__ int64_t load_readonly(const int64_t* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// Byte address of chunk 0 of `slot` in (kv, layer), without the chunk term.
__host__ __device__ __forceinline__ int64_t slot_offset(const SideDesc& d, int64_t slot) {
  if (d.page_size == 1) {
    return slot * d.s_page;
  }
  const int64_t page = slot / d.page_size;
  return page * d.s_page + (slot - page * d.page_size) * d.s_in_page;
}

// One base address plus strides: every host layout, and stacked device pools.
struct AffineSide {
  static __host__ __device__ __forceinline__ int64_t address(const SideDesc& d, int kv, int layer,
                                                             int64_t slot) {
    return d.base + kv * d.s_kv + layer * d.s_layer + slot_offset(d, slot);
  }
};

// A table of per-(kv, layer) pool addresses: layer-first pools allocated per layer.
struct TableSide {
  static __host__ __device__ __forceinline__ int64_t address(const SideDesc& d, int kv, int layer,
                                                             int64_t slot) {
    const int64_t* table = reinterpret_cast<const int64_t*>(d.base);
    return load_readonly(table + kv * d.num_layers + layer) + slot_offset(d, slot);
  }
};

// Unit (i, kv, l, c), ordered i slowest, then kv, then l, then c fastest.
struct UnitCoords {
  int64_t i;
  int kv;
  int layer;
  int c;
};

__host__ __device__ __forceinline__ UnitCoords decompose_unit(int64_t unit, int units_per_index,
                                                              int num_chunks, int layer_begin,
                                                              int layer_count) {
  UnitCoords u;
  u.i = unit / units_per_index;
  int rest = static_cast<int>(unit - u.i * units_per_index);
  u.c = rest % num_chunks;
  rest /= num_chunks;
  u.layer = layer_begin + rest % layer_count;
  u.kv = rest / layer_count;
  return u;
}

// True when both slots of a pair lie inside their pools (the bounds rule of transfer.h).
__host__ __device__ __forceinline__ bool pair_in_range(const SideDesc& src, int64_t s,
                                                       const SideDesc& dst, int64_t d) {
  return static_cast<uint64_t>(s) < static_cast<uint64_t>(src.num_slots) &&
         static_cast<uint64_t>(d) < static_cast<uint64_t>(dst.num_slots);
}

// Run-time side kind -> side functor type.
#define HICACHE_SIDE_SWITCH(is_table, Side, ...) \
  if (is_table) {                                \
    using Side = TableSide;                      \
    __VA_ARGS__                                  \
  } else {                                       \
    using Side = AffineSide;                     \
    __VA_ARGS__                                  \
  }

}  // namespace hicache
