// Ops layer of the bulk-copy transfer: argument checks (shared with launch_transfer), the sm_90
// gate, dispatch to the kernel template, the query of its loaded image (bulk_image_versions), and
// the host emulation of its schedule (bulk_schedule), which runs the kernel's own schedule and
// address code (transfer_bulk.cuh) on the CPU.
#include <vector>

#include "runtime.h"
#include "transfer.h"
#include "transfer_bulk.cuh"

namespace hicache {

namespace {

// Checks beyond launch_transfer's, and the schedule. `function` names the entry point.
cudaError_t prepare(const char* function, const SideDesc& src_desc, bool src_table,
                    const SideDesc& dst_desc, bool dst_table, const int64_t* src_idx,
                    const int64_t* dst_idx, int64_t n, int layer_begin, int layer_count, int num_kv,
                    int num_chunks, int64_t chunk_bytes, int64_t align_bytes, int num_blocks,
                    int warps_per_block, int* oob_count, BulkParams* p) {
  int64_t align = 0;
  int64_t units_per_index = 0;
  HICACHE_RETURN_IF_ERROR(detail::check_transfer_args(
      function, src_desc, src_table, dst_desc, dst_table, n, layer_begin, layer_count, num_kv,
      num_chunks, chunk_bytes, align_bytes, num_blocks, warps_per_block, &align, &units_per_index));
  HICACHE_CHECK_ARG_OF(function, align % kBulkAlign == 0,
                       "chunk_bytes, align_bytes, the affine bases and the strides used must be "
                       "multiples of ",
                       kBulkAlign, " bytes for bulk copies (use launch_transfer), their gcd is ",
                       align);
  const int64_t parts = (chunk_bytes + kBulkStageBytes - 1) / kBulkStageBytes;
  HICACHE_CHECK_ARG_OF(function, n <= INT64_MAX / (units_per_index * parts),
                       "n * num_kv * layer_count * num_chunks * ceil(chunk_bytes / ",
                       kBulkStageBytes, ") overflows int64 with n = ", n);
  *p = BulkParams{};
  if (n == 0) {
    return cudaSuccess;
  }
  HICACHE_CHECK_ARG_OF(function, src_idx != nullptr, "src_idx must not be null when n > 0 (n = ", n,
                       ")");
  HICACHE_CHECK_ARG_OF(function, dst_idx != nullptr, "dst_idx must not be null when n > 0 (n = ", n,
                       ")");
  p->src = src_desc;
  p->dst = dst_desc;
  p->src_idx = src_idx;
  p->dst_idx = dst_idx;
  p->total_units = n * units_per_index;
  p->units_per_index = static_cast<int>(units_per_index);
  p->layer_begin = layer_begin;
  p->layer_count = layer_count;
  p->num_chunks = num_chunks;
  p->chunk_bytes = chunk_bytes;
  p->oob_count = oob_count;
  bulk_plan(*p);
  return cudaSuccess;
}

// The kernel's loop for CTA `block`, on the host: every copy it issues, in order.
template <class SrcSide, class DstSide>
void emulate_block(const BulkParams& p, int grid, int block, std::vector<BulkCopy>* copies,
                   int64_t* oob_count) {
  int64_t round = 0;
  for (int64_t batch = block; batch < p.num_batches; batch += grid, ++round) {
    const int slot = bulk_slot(round, p.stages);
    int64_t first = 0;
    const int64_t count = bulk_batch_pieces(p, batch, &first);
    for (int k = 0; k < count; ++k) {
      int64_t src = 0;
      int64_t dst = 0;
      uint32_t bytes = 0;
      bool counted = false;
      if (locate_piece<SrcSide, DstSide>(p, first + k, src, dst, bytes, counted)) {
        copies->push_back(BulkCopy{
            block, round, slot, bulk_parity(round, p.stages),
            static_cast<int64_t>(slot) * p.stage_bytes + static_cast<int64_t>(k) * p.piece_stride,
            src, dst, bytes});
      } else if (counted) {
        ++*oob_count;
      }
    }
  }
}

}  // namespace

cudaError_t bulk_image_versions(int device, int* binary_version, int* ptx_version) {
  clear_argument_error();
  // Every instantiation lives in this file's module, so one answers for all.
  return detail::image_versions_of(
      __func__, reinterpret_cast<const void*>(transfer_bulk_kernel<AffineSide, AffineSide>), device,
      binary_version, ptx_version);
}

int bulk_ring_stages() { return kBulkStages; }
int bulk_stage_bytes() { return kBulkStageBytes; }

cudaError_t launch_transfer_bulk(const SideDesc& src_desc, bool src_table, const SideDesc& dst_desc,
                                 bool dst_table, const int64_t* src_idx, const int64_t* dst_idx,
                                 int64_t n, int layer_begin, int layer_count, int num_kv,
                                 int num_chunks, int64_t chunk_bytes, int64_t align_bytes,
                                 int num_blocks, int warps_per_block, int* oob_count,
                                 cudaStream_t stream) {
  clear_argument_error();
  BulkParams p;
  HICACHE_RETURN_IF_ERROR(prepare(__func__, src_desc, src_table, dst_desc, dst_table, src_idx,
                                  dst_idx, n, layer_begin, layer_count, num_kv, num_chunks,
                                  chunk_bytes, align_bytes, num_blocks, warps_per_block, oob_count,
                                  &p));
  if (n == 0) {
    return cudaSuccess;
  }
  // The kernel body exists only in sm_90+ images; refuse older devices before launching.
  int device = 0;
  HICACHE_RETURN_IF_ERROR(cudaGetDevice(&device));
  int major = 0;
  HICACHE_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) {
    return cudaErrorNotSupported;
  }
  const int grid = bulk_grid(p, num_blocks);
  bulk_ring(p, grid);
  HICACHE_SIDE_SWITCH(src_table, SrcSide, {HICACHE_SIDE_SWITCH(dst_table, DstSide, {
                        return launch_transfer_bulk_kernel<SrcSide, DstSide>(p, grid, stream);
                      })})
}

cudaError_t bulk_schedule(const SideDesc& src_desc, bool src_table, const SideDesc& dst_desc,
                          bool dst_table, const int64_t* src_idx, const int64_t* dst_idx, int64_t n,
                          int layer_begin, int layer_count, int num_kv, int num_chunks,
                          int64_t chunk_bytes, int64_t align_bytes, int num_blocks,
                          int warps_per_block, std::vector<BulkCopy>* copies, int64_t* oob_count,
                          int64_t* blocks, int64_t* stages, int64_t* stage_bytes) {
  clear_argument_error();
  BulkParams p;
  HICACHE_RETURN_IF_ERROR(prepare(__func__, src_desc, src_table, dst_desc, dst_table, src_idx,
                                  dst_idx, n, layer_begin, layer_count, num_kv, num_chunks,
                                  chunk_bytes, align_bytes, num_blocks, warps_per_block, nullptr,
                                  &p));
  *blocks = 0;
  *stages = 0;
  *stage_bytes = 0;
  if (n == 0) {
    return cudaSuccess;
  }
  const int grid = bulk_grid(p, num_blocks);
  bulk_ring(p, grid);
  *blocks = grid;
  *stages = p.stages;
  *stage_bytes = p.stage_bytes;
  for (int b = 0; b < grid; ++b) {
    HICACHE_SIDE_SWITCH(src_table, SrcSide, {HICACHE_SIDE_SWITCH(dst_table, DstSide, {
                          emulate_block<SrcSide, DstSide>(p, grid, b, copies, oob_count);
                        })})
  }
  return cudaSuccess;
}

}  // namespace hicache
