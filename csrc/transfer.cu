// Ops layer of the transfer kernels: validates arguments, picks the vector width from the
// alignment of everything the kernel will address, and dispatches to the kernel template.
#include <climits>
#include <numeric>

#include "transfer.cuh"
#include "transfer.h"

namespace hicache {

namespace {

// The checks of one SideDesc, reported as errors of `function` about argument `name`.
cudaError_t check_side(const char* function, const char* name, const SideDesc& d, bool table) {
  HICACHE_CHECK_ARG_OF(function, d.base != 0, name, ".base must not be 0");
  // A table is read as int64 entries, so it must be 8-byte aligned.
  HICACHE_CHECK_ARG_OF(function, !table || d.base % 8 == 0, name,
                       ".base must be 8-byte aligned for a table side (an int64 array), got ",
                       d.base);
  HICACHE_CHECK_ARG_OF(function, d.num_layers >= 1, name, ".num_layers must be >= 1, got ",
                       d.num_layers);
  HICACHE_CHECK_ARG_OF(function, d.page_size >= 1, name, ".page_size must be >= 1, got ",
                       d.page_size);
  HICACHE_CHECK_ARG_OF(function, d.num_slots >= 0, name, ".num_slots must be >= 0, got ",
                       d.num_slots);
  HICACHE_CHECK_ARG_OF(function, d.s_kv >= 0, name, ".s_kv must be >= 0, got ", d.s_kv);
  HICACHE_CHECK_ARG_OF(function, d.s_layer >= 0, name, ".s_layer must be >= 0, got ", d.s_layer);
  HICACHE_CHECK_ARG_OF(function, d.s_page >= 0, name, ".s_page must be >= 0, got ", d.s_page);
  HICACHE_CHECK_ARG_OF(function, d.s_in_page >= 0, name, ".s_in_page must be >= 0, got ",
                       d.s_in_page);
  HICACHE_CHECK_ARG_OF(function, d.s_chunk >= 0, name, ".s_chunk must be >= 0, got ", d.s_chunk);
  return cudaSuccess;
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
cudaError_t dispatch_sides(bool src_table, bool dst_table, bool dst_host, const TransferParams& p,
                           int64_t chunk_bytes, int num_blocks, int warps_per_block,
                           cudaStream_t stream) {
  HICACHE_SIDE_SWITCH(
      src_table, SrcSide,
      {HICACHE_SIDE_SWITCH(dst_table, DstSide, {HICACHE_STORE_SWITCH(dst_host, Store, {
                             return launch_transfer_kernel<SrcSide, DstSide, Store, kVec>(
                                 p, chunk_bytes, num_blocks, warps_per_block, stream);
                           })})})
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

namespace detail {

cudaError_t check_transfer_args(const char* function, const SideDesc& src_desc, bool src_table,
                                const SideDesc& dst_desc, bool dst_table, int64_t n,
                                int layer_begin, int layer_count, int num_kv, int num_chunks,
                                int64_t chunk_bytes, int64_t align_bytes, int num_blocks,
                                int warps_per_block, int64_t* align, int64_t* units_per_index) {
  constexpr int kMaxWarps = kTransferMaxThreads / 32;
  HICACHE_CHECK_ARG_OF(function, n >= 0, "n must be >= 0, got ", n);
  HICACHE_CHECK_ARG_OF(function, layer_begin >= 0, "layer_begin must be >= 0, got ", layer_begin);
  HICACHE_CHECK_ARG_OF(function, layer_count >= 1, "layer_count must be >= 1, got ", layer_count);
  HICACHE_CHECK_ARG_OF(function, num_kv >= 1, "num_kv must be >= 1, got ", num_kv);
  HICACHE_CHECK_ARG_OF(function, num_chunks >= 1, "num_chunks must be >= 1, got ", num_chunks);
  HICACHE_CHECK_ARG_OF(function, chunk_bytes >= 1, "chunk_bytes must be >= 1, got ", chunk_bytes);
  HICACHE_CHECK_ARG_OF(function, align_bytes >= 0, "align_bytes must be >= 0, got ", align_bytes);
  HICACHE_CHECK_ARG_OF(function, num_blocks >= 1, "num_blocks must be >= 1, got ", num_blocks);
  HICACHE_CHECK_ARG_OF(function, warps_per_block >= 1 && warps_per_block <= kMaxWarps,
                       "warps_per_block must be in [1, ", kMaxWarps, "], got ", warps_per_block);
  HICACHE_RETURN_IF_ERROR(check_side(function, "src_desc", src_desc, src_table));
  HICACHE_RETURN_IF_ERROR(check_side(function, "dst_desc", dst_desc, dst_table));
  const int64_t layer_end = static_cast<int64_t>(layer_begin) + layer_count;
  HICACHE_CHECK_ARG_OF(function, layer_end <= src_desc.num_layers,
                       "layer_begin + layer_count must be <= src_desc.num_layers (",
                       src_desc.num_layers, "), got ", layer_begin, " + ", layer_count);
  HICACHE_CHECK_ARG_OF(function, layer_end <= dst_desc.num_layers,
                       "layer_begin + layer_count must be <= dst_desc.num_layers (",
                       dst_desc.num_layers, "), got ", layer_begin, " + ", layer_count);
  // Work units are counted in int per index and in int64 overall.
  const int64_t units = static_cast<int64_t>(num_kv) * layer_count * num_chunks;
  HICACHE_CHECK_ARG_OF(function, units <= INT_MAX,
                       "num_kv * layer_count * num_chunks must be <= ", INT_MAX, ", got ", units);
  HICACHE_CHECK_ARG_OF(function, n <= INT64_MAX / units, "n * num_kv * layer_count * num_chunks (",
                       units, " per index) overflows int64 with n = ", n);
  int64_t g = std::gcd(align_bytes, chunk_bytes);
  g = std::gcd(g, side_alignment(src_desc, src_table, num_kv, num_chunks));
  g = std::gcd(g, side_alignment(dst_desc, dst_table, num_kv, num_chunks));
  *align = g;
  *units_per_index = units;
  return cudaSuccess;
}

}  // namespace detail

cudaError_t launch_transfer(const SideDesc& src_desc, bool src_table, const SideDesc& dst_desc,
                            bool dst_table, const int64_t* src_idx, const int64_t* dst_idx,
                            int64_t n, int layer_begin, int layer_count, int num_kv, int num_chunks,
                            int64_t chunk_bytes, int64_t align_bytes, int num_blocks,
                            int warps_per_block, int* oob_count, cudaStream_t stream,
                            bool dst_host) {
  clear_argument_error();
  int64_t align = 0;
  int64_t units_per_index = 0;
  HICACHE_RETURN_IF_ERROR(detail::check_transfer_args(
      __func__, src_desc, src_table, dst_desc, dst_table, n, layer_begin, layer_count, num_kv,
      num_chunks, chunk_bytes, align_bytes, num_blocks, warps_per_block, &align, &units_per_index));
  const int vec = vector_bytes(align);
  // The kernel counts vectors of a chunk in int, with room for one step of 32 lanes.
  HICACHE_CHECK_ARG(chunk_bytes / vec <= INT_MAX - 64, "chunk_bytes must be at most ", INT_MAX - 64,
                    " vectors of ", vec, " bytes, got ", chunk_bytes);
  if (n == 0) {
    return cudaSuccess;
  }
  HICACHE_CHECK_ARG(src_idx != nullptr, "src_idx must not be null when n > 0 (n = ", n, ")");
  HICACHE_CHECK_ARG(dst_idx != nullptr, "dst_idx must not be null when n > 0 (n = ", n, ")");
  TransferParams p{};
  p.src = src_desc;
  p.dst = dst_desc;
  p.src_idx = src_idx;
  p.dst_idx = dst_idx;
  p.total_units = n * units_per_index;
  p.units_per_index = static_cast<int>(units_per_index);
  p.layer_begin = layer_begin;
  p.layer_count = layer_count;
  p.num_chunks = num_chunks;
  p.oob_count = oob_count;
  HICACHE_VEC_SWITCH(vec, kVec, {
    return dispatch_sides<kVec>(src_table, dst_table, dst_host, p, chunk_bytes, num_blocks,
                                warps_per_block, stream);
  })
}

}  // namespace hicache
