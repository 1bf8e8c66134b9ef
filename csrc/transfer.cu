// Ops layer of the transfer kernels: validates arguments, picks the vector width from the
// alignment of everything the kernel will address, and dispatches to the kernel template.
#include <climits>
#include <numeric>

#include "transfer.cuh"
#include "transfer.h"

namespace hicache {

namespace {

bool valid_side(const SideDesc& d, bool table) {
  // A table is read as int64 entries, so it must be 8-byte aligned.
  return d.base != 0 && (!table || d.base % 8 == 0) && d.num_layers >= 1 && d.page_size >= 1 &&
         d.num_slots >= 0 && d.s_kv >= 0 && d.s_layer >= 0 && d.s_page >= 0 && d.s_in_page >= 0 &&
         d.s_chunk >= 0;
}

// gcd of the side's base (affine) and of every stride the transfer multiplies by a non-zero value.
int64_t side_alignment(const SideDesc& d, bool table, int num_kv, int num_chunks) {
  int64_t g = 0;
  if (!table) {
    g = std::gcd(g, d.base);
    if (num_kv > 1) {
      g = std::gcd(g, d.s_kv);
    }
    g = std::gcd(g, d.s_layer);
  }
  g = std::gcd(g, d.s_page);
  if (d.page_size > 1) {
    g = std::gcd(g, d.s_in_page);
  }
  if (num_chunks > 1) {
    g = std::gcd(g, d.s_chunk);
  }
  return g;
}

template <int kVec>
cudaError_t dispatch_sides(bool src_table, bool dst_table, const TransferParams& p,
                           int64_t chunk_bytes, int num_blocks, int warps_per_block,
                           cudaStream_t stream) {
  HICACHE_SIDE_SWITCH(src_table, SrcSide, {
    HICACHE_SIDE_SWITCH(dst_table, DstSide, {
      return launch_transfer_kernel<SrcSide, DstSide, kVec>(p, chunk_bytes, num_blocks,
                                                            warps_per_block, stream);
    })
  })
}

}  // namespace

int vector_bytes(int64_t align_bytes) {
  if (align_bytes < 0) {
    return 0;
  }
  if (align_bytes == 0) {
    return 16;
  }
  const int64_t low_bit = align_bytes & -align_bytes;
  return static_cast<int>(low_bit < 16 ? low_bit : 16);
}

cudaError_t launch_transfer(const SideDesc& src, bool src_table, const SideDesc& dst,
                            bool dst_table, const int64_t* src_idx, const int64_t* dst_idx,
                            int64_t n, int layer_begin, int layer_count, int num_kv,
                            int num_chunks, int64_t chunk_bytes, int64_t align_bytes,
                            int num_blocks, int warps_per_block, int* oob_count,
                            cudaStream_t stream) {
  if (n < 0 || layer_begin < 0 || layer_count < 1 || num_kv < 1 || num_chunks < 1 ||
      chunk_bytes < 1 || align_bytes < 0 || num_blocks < 1 || warps_per_block < 1 ||
      warps_per_block > kTransferMaxThreads / 32) {
    return cudaErrorInvalidValue;
  }
  if (!valid_side(src, src_table) || !valid_side(dst, dst_table) ||
      static_cast<int64_t>(layer_begin) + layer_count > src.num_layers ||
      static_cast<int64_t>(layer_begin) + layer_count > dst.num_layers) {
    return cudaErrorInvalidValue;
  }
  const int64_t units_per_index = static_cast<int64_t>(num_kv) * layer_count * num_chunks;
  if (units_per_index > INT_MAX || n > INT64_MAX / units_per_index) {
    return cudaErrorInvalidValue;
  }
  int64_t align = std::gcd(align_bytes, chunk_bytes);
  align = std::gcd(align, side_alignment(src, src_table, num_kv, num_chunks));
  align = std::gcd(align, side_alignment(dst, dst_table, num_kv, num_chunks));
  const int vec = vector_bytes(align);
  // The kernel counts vectors of a chunk in int, with room for one step of 32 lanes.
  if (chunk_bytes / vec > INT_MAX - 64) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) {
    return cudaSuccess;
  }
  if (src_idx == nullptr || dst_idx == nullptr) {
    return cudaErrorInvalidValue;
  }
  TransferParams p{};
  p.src = src;
  p.dst = dst;
  p.src_idx = src_idx;
  p.dst_idx = dst_idx;
  p.total_units = n * units_per_index;
  p.units_per_index = static_cast<int>(units_per_index);
  p.layer_begin = layer_begin;
  p.layer_count = layer_count;
  p.num_chunks = num_chunks;
  p.oob_count = oob_count;
  HICACHE_VEC_SWITCH(vec, kVec, {
    return dispatch_sides<kVec>(src_table, dst_table, p, chunk_bytes, num_blocks, warps_per_block,
                                stream);
  })
}

}  // namespace hicache
