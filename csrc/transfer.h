// Torch-free entry point of the transfer kernels: gather/scatter of KV-cache chunks between two
// pools described by byte geometry (see hicache_kernels/plan.py). Host-compilable (no device code).
//
// A transfer copies, for each index i in [0, n), each layer l in [layer_begin, layer_begin +
// layer_count), each kv in [0, num_kv) and each chunk c in [0, num_chunks), chunk_bytes bytes from
// src.address(kv, l, src_idx[i], c) to dst.address(kv, l, dst_idx[i], c), where with
// page = slot / page_size and off = slot % page_size:
//   affine: base + kv * s_kv + l * s_layer + page * s_page + off * s_in_page + c * s_chunk
//   table:  ((const int64_t*)base)[kv * num_layers + l] + page * s_page + off * s_in_page
//           + c * s_chunk
#pragma once

#include <cstdint>
#include <vector>

#include "common.cuh"

namespace hicache {

// One side of a transfer, field for field plan.Side.desc(). Addresses and strides are in BYTES;
// num_layers, page_size and num_slots are counts. For a table side, `base` is the DEVICE address of
// an int64 table of num_kv * num_layers pool addresses and s_kv / s_layer are unused.
struct SideDesc {
  int64_t base;
  int64_t num_layers;
  int64_t s_kv;
  int64_t s_layer;
  int64_t s_page;
  int64_t s_in_page;
  int64_t s_chunk;
  int64_t page_size;
  int64_t num_slots;
};

// The width (16, 8, 4, 2 or 1 bytes) of the vectors a transfer moves when every address and
// stride it uses is a multiple of `align_bytes`: the largest power of two <= 16 dividing it.
// align_bytes == 0 means "no constraint" (16); negative values return 0 (invalid).
int vector_bytes(int64_t align_bytes);

// Launch one transfer on `stream`. src_idx / dst_idx: device arrays of n int64 slot indices.
// align_bytes: a common divisor of every table entry the caller's table sides hold (0 when there
// are none); the launcher combines it with the affine bases, the strides used and chunk_bytes to
// pick the vector width (vector_bytes). num_blocks x warps_per_block warps loop over the work.
// Units (i, kv, l, c) whose src index is outside [0, src_desc.num_slots) or dst index outside
// [0, dst_desc.num_slots) write nothing and, when oob_count (device int*) is not null, are added
// to it. Every argument is checked before any CUDA call: a bad one returns cudaErrorInvalidValue
// with argument_error() naming it (common.cuh). Returns cudaSuccess without launching when n == 0,
// else the launch status. Launches on the current device, which must be the stream's. dst_host:
// the destination is (pinned) host memory, which picks the stores' cache policy (transfer.cuh):
// streaming (evict-first) for host destinations, write-back for device ones.
cudaError_t launch_transfer(const SideDesc& src_desc, bool src_table, const SideDesc& dst_desc,
                            bool dst_table, const int64_t* src_idx, const int64_t* dst_idx,
                            int64_t n, int layer_begin, int layer_count, int num_kv, int num_chunks,
                            int64_t chunk_bytes, int64_t align_bytes, int num_blocks,
                            int warps_per_block, int* oob_count, cudaStream_t stream,
                            bool dst_host);

// The same transfer through the bulk-copy pipeline (sm_90 and newer, transfer_bulk.cuh): each CTA
// streams contiguous runs of its units through a shared-memory ring with cp.async.bulk, ordered by
// mbarriers, its stores with the default cache policy. Same arguments (but dst_host), checks,
// bounds rule (skipped and counted), n == 0 behaviour and grid cap (num_blocks) as launch_transfer;
// warps_per_block is checked the same way but a CTA is always kBulkThreads threads (one loader and
// one storer warp). Refused with cudaErrorInvalidValue and an argument_error() unless chunk_bytes,
// every stride used, every affine base and align_bytes are multiples of 16 (bulk copies move
// 16-byte multiples between 16-byte-aligned addresses): callers then use launch_transfer. Returns
// cudaErrorNotSupported, launching nothing, when the current device's compute capability is
// below 9.0. The kernel's body exists only in code compiled for sm_90+; an image compiled for an
// older arch (PTX JIT-compiled by the driver, as a "8.0+PTX" build on an H100 would be) traps,
// failing the launch: callers ask bulk_image_versions first.
cudaError_t launch_transfer_bulk(const SideDesc& src_desc, bool src_table, const SideDesc& dst_desc,
                                 bool dst_table, const int64_t* src_idx, const int64_t* dst_idx,
                                 int64_t n, int layer_begin, int layer_count, int num_kv,
                                 int num_chunks, int64_t chunk_bytes, int64_t align_bytes,
                                 int num_blocks, int warps_per_block, int* oob_count,
                                 cudaStream_t stream);

// binaryVersion / ptxVersion of the bulk kernel's code the driver loads for `device` (as
// kernel_image_versions of runtime.h, for this kernel). The copy runs only when both are >= 90:
// ptxVersion is the arch the code was compiled for (__CUDA_ARCH__), binaryVersion the SASS it runs
// as, which for PTX JIT-compiled by the driver may be the device's arch whatever the PTX's.
cudaError_t bulk_image_versions(int device, int* binary_version, int* ptx_version);

// One bulk copy of the pipeline: in CTA `block`'s `round`, ring slot `slot` (waited on with phase
// parity `parity`) holds `bytes` bytes at byte `smem_offset` of the ring, loaded from `src` and
// stored to `dst`.
struct BulkCopy {
  int64_t block;
  int64_t round;
  int64_t slot;
  int64_t parity;
  int64_t smem_offset;
  int64_t src;
  int64_t dst;
  int64_t bytes;
};

// The largest ring of launch_transfer_bulk: stages per CTA and bytes per stage (a launch sizes its
// ring to its work: bulk_schedule reports it).
int bulk_ring_stages();
int bulk_stage_bytes();

// Host emulation of launch_transfer_bulk with the kernel's own schedule and address code: the same
// arguments and checks (src_idx / dst_idx and table sides' tables are HOST memory here), appending
// every copy the kernel would issue, in each CTA's issue order, to *copies; *oob_count += units
// skipped; *blocks = the grid the launch would use, *stages and *stage_bytes = its ring (dynamic
// shared memory: stages x stage_bytes per CTA).
cudaError_t bulk_schedule(const SideDesc& src_desc, bool src_table, const SideDesc& dst_desc,
                          bool dst_table, const int64_t* src_idx, const int64_t* dst_idx, int64_t n,
                          int layer_begin, int layer_count, int num_kv, int num_chunks,
                          int64_t chunk_bytes, int64_t align_bytes, int num_blocks,
                          int warps_per_block, std::vector<BulkCopy>* copies, int64_t* oob_count,
                          int64_t* blocks, int64_t* stages, int64_t* stage_bytes);

namespace detail {
// The argument checks launch_transfer and its variants share, reported as errors of `function`.
// On success, *align = the gcd of align_bytes, chunk_bytes, the affine bases and every stride the
// transfer multiplies by a non-zero value; *units_per_index = num_kv * layer_count * num_chunks.
cudaError_t check_transfer_args(const char* function, const SideDesc& src_desc, bool src_table,
                                const SideDesc& dst_desc, bool dst_table, int64_t n,
                                int layer_begin, int layer_count, int num_kv, int num_chunks,
                                int64_t chunk_bytes, int64_t align_bytes, int num_blocks,
                                int warps_per_block, int64_t* align, int64_t* units_per_index);
}  // namespace detail

}  // namespace hicache
