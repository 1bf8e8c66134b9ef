// Transfer kernel family: header-only device code and its templated launcher (no framework code).
// Geometry and argument meaning: transfer.h.
//
// Work: a unit is one chunk (i, kv, l, c), ordered i slowest, then kv, then l, then c fastest, so
// neighbouring workers touch neighbouring host memory for page-first layouts. A small fixed grid of
// warps loops over the units grid-stride. Each warp is split into sub-warps of G = 2^k lanes,
// G = min(32, next_pow2(vectors per chunk)), one unit per sub-warp at a time, so every instruction
// of a sub-warp covers min(chunk, 32 vectors) contiguous bytes. A lane walks its sub-warp's
// (unit, step) sequence (step s covers vectors [s * G, s * G + G) of the unit) and issues kUnroll
// independent loads (spanning several units when chunks are small) before the matching stores,
// keeping up to 32 * kUnroll * kVecBytes bytes (2 KiB at 16 B) in flight per warp.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "sides.cuh"
#include "transfer.h"

namespace hicache {

constexpr int kTransferUnroll = 4;            // independent vectors in flight per lane
constexpr int kTransferMaxThreads = 32 * 32;  // warps_per_block <= 32

// Register type of one vector; 1-byte vectors live in a 16-bit register (PTX has no 8-bit ones).
template <int kVecBytes>
struct Vec;
template <>
struct Vec<16> {
  using type = uint4;
};
template <>
struct Vec<8> {
  using type = uint2;
};
template <>
struct Vec<4> {
  using type = uint32_t;
};
template <>
struct Vec<2> {
  using type = uint16_t;
};
template <>
struct Vec<1> {
  using type = uint16_t;
};

// Loads: non-coherent path without L1 allocation (the source is never written during a transfer).
// Pinned host memory is accessed through its device address, so every byte crosses the link
// exactly once. `volatile` keeps all loads of a round ahead of its stores.
template <int kVecBytes>
__device__ __forceinline__ typename Vec<kVecBytes>::type load_vec(const char* p);

template <>
__device__ __forceinline__ uint4 load_vec<16>(const char* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ uint2 load_vec<8>(const char* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ uint32_t load_vec<4>(const char* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ uint16_t load_vec<2>(const char* p) {
  uint16_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ uint16_t load_vec<1>(const char* p) {
  uint16_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

// Store cache policies, a template parameter of the kernel chosen by the destination's memory in
// one place (HICACHE_STORE_SWITCH). Host destinations (backups, d2h) get streaming stores
// (st.global.cs, evict-first): nothing on the GPU reads those lines again. Device destinations
// (loads, h2d) get the default write-back policy (st.global): attention reads the loaded pages
// next, so their lines should stay in L2 rather than be evicted first.
struct StreamingStore {
  static constexpr bool kEvictFirst = true;
};
struct WriteBackStore {
  static constexpr bool kEvictFirst = false;
};

// One store instruction, "st.global" or "st.global.cs" followed by `operation` (type and operands)
// and the asm operand lists, by Store's policy.
#define HICACHE_STORE_ASM(Store, operation, ...)        \
  if constexpr (Store::kEvictFirst) {                   \
    asm volatile("st.global.cs" operation __VA_ARGS__); \
  } else {                                              \
    asm volatile("st.global" operation __VA_ARGS__);    \
  }

template <class Store, int kVecBytes>
__device__ __forceinline__ void store_vec(char* p, typename Vec<kVecBytes>::type v) {
  if constexpr (kVecBytes == 16) {
    HICACHE_STORE_ASM(Store, ".v4.u32 [%0], {%1, %2, %3, %4};", ::"l"(p), "r"(v.x), "r"(v.y),
                      "r"(v.z), "r"(v.w) : "memory")
  } else if constexpr (kVecBytes == 8) {
    HICACHE_STORE_ASM(Store, ".v2.u32 [%0], {%1, %2};", ::"l"(p), "r"(v.x), "r"(v.y) : "memory")
  } else if constexpr (kVecBytes == 4) {
    HICACHE_STORE_ASM(Store, ".u32 [%0], %1;", ::"l"(p), "r"(v) : "memory")
  } else if constexpr (kVecBytes == 2) {
    HICACHE_STORE_ASM(Store, ".u16 [%0], %1;", ::"l"(p), "h"(v) : "memory")
  } else {
    static_assert(kVecBytes == 1, "vector widths are 16, 8, 4, 2 or 1 bytes");
    HICACHE_STORE_ASM(Store, ".u8 [%0], %1;", ::"l"(p), "h"(v) : "memory")
  }
}

#undef HICACHE_STORE_ASM

// The one place the store policy is decided: by whether the destination is host memory.
#define HICACHE_STORE_SWITCH(dst_host, Store, ...) \
  if (dst_host) {                                  \
    using Store = StreamingStore;                  \
    __VA_ARGS__                                    \
  } else {                                         \
    using Store = WriteBackStore;                  \
    __VA_ARGS__                                    \
  }

struct TransferParams {
  SideDesc src;
  SideDesc dst;
  const int64_t* src_idx;  // device, n entries
  const int64_t* dst_idx;  // device, n entries
  int64_t total_units;     // n * units_per_index
  int units_per_index;     // num_kv * layer_count * num_chunks
  int layer_begin;
  int layer_count;
  int num_chunks;
  int vecs_per_chunk;  // chunk_bytes / kVecBytes
  int group_shift;     // log2 of the sub-warp size G
  int steps_per_unit;  // ceil(vecs_per_chunk / G)
  int* oob_count;      // device counter of skipped units, or nullptr
};

// Resolve `unit` to its source and destination chunk; false (and counted once per unit) when an
// index is out of range.
template <class SrcSide, class DstSide>
__device__ __forceinline__ bool locate_unit(const TransferParams& p, int64_t unit, bool leader,
                                            const char*& src, char*& dst) {
  const UnitCoords u =
      decompose_unit(unit, p.units_per_index, p.num_chunks, p.layer_begin, p.layer_count);
  const int kv = u.kv;
  const int layer = u.layer;
  const int c = u.c;
  const int64_t s = __ldg(p.src_idx + u.i);
  const int64_t d = __ldg(p.dst_idx + u.i);
  if (!pair_in_range(p.src, s, p.dst, d)) {
    if (leader && p.oob_count != nullptr) {
      atomicAdd(p.oob_count, 1);
    }
    return false;
  }
  src = reinterpret_cast<const char*>(SrcSide::address(p.src, kv, layer, s) + c * p.src.s_chunk);
  dst = reinterpret_cast<char*>(DstSide::address(p.dst, kv, layer, d) + c * p.dst.s_chunk);
  return true;
}

template <class SrcSide, class DstSide, class Store, int kVecBytes>
__global__ void __launch_bounds__(kTransferMaxThreads)
    transfer_kernel(const __grid_constant__ TransferParams p) {
  using V = typename Vec<kVecBytes>::type;
  const int lane = threadIdx.x & 31;
  const int sub_lane = lane & ((1 << p.group_shift) - 1);
  const int64_t groups_per_warp = 32 >> p.group_shift;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5) * groups_per_warp;
  int64_t unit = warp * groups_per_warp + (lane >> p.group_shift);
  if (unit >= p.total_units) {
    return;
  }
  const char* src = nullptr;
  char* dst = nullptr;
  bool ok = locate_unit<SrcSide, DstSide>(p, unit, sub_lane == 0, src, dst);
  int step = 0;
  while (unit < p.total_units) {
    V buf[kTransferUnroll];
    char* out[kTransferUnroll];
#pragma unroll
    for (int t = 0; t < kTransferUnroll; ++t) {
      const int v = sub_lane + (step << p.group_shift);
      out[t] = nullptr;
      if (unit < p.total_units && ok && v < p.vecs_per_chunk) {
        const int64_t off = static_cast<int64_t>(v) * kVecBytes;
        buf[t] = load_vec<kVecBytes>(src + off);
        out[t] = dst + off;
      }
      if (++step == p.steps_per_unit) {
        step = 0;
        unit += stride;
        if (unit < p.total_units) {
          ok = locate_unit<SrcSide, DstSide>(p, unit, sub_lane == 0, src, dst);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kTransferUnroll; ++t) {
      if (out[t] != nullptr) {
        store_vec<Store, kVecBytes>(out[t], buf[t]);
      }
    }
  }
}

// The one launcher: `p` is complete except the sub-warp geometry, derived here from kVecBytes.
template <class SrcSide, class DstSide, class Store, int kVecBytes>
cudaError_t launch_transfer_kernel(TransferParams p, int64_t chunk_bytes, int num_blocks,
                                   int warps_per_block, cudaStream_t stream) {
  p.vecs_per_chunk = static_cast<int>(chunk_bytes / kVecBytes);
  p.group_shift = 0;
  while (p.group_shift < 5 && (1 << p.group_shift) < p.vecs_per_chunk) {
    ++p.group_shift;
  }
  const int group = 1 << p.group_shift;
  p.steps_per_unit = (p.vecs_per_chunk + group - 1) / group;
  // Never more blocks than the work can occupy (one unit per sub-warp).
  const int64_t workers_per_block = static_cast<int64_t>(warps_per_block) * (32 / group);
  const int64_t blocks_needed = (p.total_units + workers_per_block - 1) / workers_per_block;
  const int blocks = static_cast<int>(blocks_needed < num_blocks ? blocks_needed : num_blocks);
  transfer_kernel<SrcSide, DstSide, Store, kVecBytes>
      <<<blocks, warps_per_block * 32, 0, stream>>>(p);
  HICACHE_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

// Run-time vector width -> compile-time kVec. An unexpected width fails loudly.
#define HICACHE_VEC_SWITCH(vec_bytes, kVec, ...) \
  switch (vec_bytes) {                           \
    case 16: {                                   \
      constexpr int kVec = 16;                   \
      __VA_ARGS__                                \
    }                                            \
    case 8: {                                    \
      constexpr int kVec = 8;                    \
      __VA_ARGS__                                \
    }                                            \
    case 4: {                                    \
      constexpr int kVec = 4;                    \
      __VA_ARGS__                                \
    }                                            \
    case 2: {                                    \
      constexpr int kVec = 2;                    \
      __VA_ARGS__                                \
    }                                            \
    case 1: {                                    \
      constexpr int kVec = 1;                    \
      __VA_ARGS__                                \
    }                                            \
    default:                                     \
      return cudaErrorInvalidValue;              \
  }

}  // namespace hicache
