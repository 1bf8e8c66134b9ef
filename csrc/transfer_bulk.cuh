// Bulk-copy transfer kernel (sm_90 and newer): header-only device code, its schedule (shared with
// the host emulation) and its templated launcher. Geometry and argument meaning: transfer.h.
//
// Work: the units (i, kv, l, c) of transfer.cuh, in the same order, each cut into parts of at most
// kBulkStageBytes (a "piece": one contiguous run of a chunk). Pieces are packed into batches of
// pieces_per_stage (a stage holds floor(kBulkStageBytes / piece_stride) pieces, piece_stride =
// min(chunk_bytes, kBulkStageBytes)); batch b belongs to CTA b % grid, as that CTA's round
// b / grid. A CTA owns a ring of `stages` stages of `stage_bytes` each, in dynamic shared memory
// sized per launch (bulk_ring): at most kBulkStages stages (fewer when a CTA has fewer rounds) of
// at most kBulkStageBytes (only the bytes a batch's pieces use, rounded up to 128), so a launch of
// small items or few rounds asks for less than the 32 KiB maximum and fits beside more of another
// kernel's CTAs. Round r uses slot r % stages and its mbarriers' phase parity (r / stages) & 1.
//
// Per CTA, warp 0 (the loader) waits until the slot is free (its "empty" mbarrier); each lane takes
// the batch's pieces lane, lane + 32, ... (their addresses computed in parallel), announces its
// bytes (mbarrier.expect_tx, before its own copy) and issues one global->shared cp.async.bulk per
// piece, which completes on the slot's "full" mbarrier; after a __syncwarp lane 0 makes the phase's
// one arrival. Warp 1 (the storer) waits on "full"; each lane issues one shared->global
// cp.async.bulk per piece of its share as its own bulk group (groups are per thread), waits until
// its older groups have finished reading shared memory (cp.async.bulk.wait_group.read 1), and after
// a __syncwarp lane 0 frees the slot of the previous round. Out-of-range pairs are skipped by both
// (same rule) and counted once per unit by the loader lane that met them. Every address and size is
// a multiple of 16 (the launcher refuses anything else).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "sides.cuh"
#include "transfer.h"

namespace hicache {

constexpr int kBulkStages = 4;         // most ring stages per CTA
constexpr int kBulkStageBytes = 8192;  // most bytes per stage: at most 32 KiB of dynamic shared
                                       // memory per CTA (under the 48 KiB needing no opt-in)
constexpr int kBulkStageAlign = 128;   // a stage's bytes are rounded up to this
constexpr int kBulkThreads = 64;       // warp 0 loads, warp 1 stores (every lane issues)
constexpr int kBulkAlign = 16;         // cp.async.bulk: sizes and addresses multiples of 16

struct BulkParams {
  SideDesc src;
  SideDesc dst;
  const int64_t* src_idx;  // n entries (device; host in the emulation)
  const int64_t* dst_idx;
  int64_t total_units;  // n * units_per_index
  int units_per_index;  // num_kv * layer_count * num_chunks
  int layer_begin;
  int layer_count;
  int num_chunks;
  int64_t chunk_bytes;
  int64_t parts_per_unit;  // ceil(chunk_bytes / kBulkStageBytes)
  int piece_stride;        // min(chunk_bytes, kBulkStageBytes): ring bytes per piece
  int pieces_per_stage;    // kBulkStageBytes / piece_stride
  int64_t total_pieces;    // total_units * parts_per_unit
  int64_t num_batches;     // ceil(total_pieces / pieces_per_stage)
  int stages;              // ring stages per CTA (bulk_ring)
  int stage_bytes;         // ring bytes per stage (bulk_ring), a multiple of kBulkStageAlign
  int* oob_count;          // device counter of skipped units, or nullptr
};

// Fill the schedule fields of `p` from its chunk_bytes and total_units (the caller checked that
// total_units * parts_per_unit does not overflow).
inline void bulk_plan(BulkParams& p) {
  p.parts_per_unit = (p.chunk_bytes + kBulkStageBytes - 1) / kBulkStageBytes;
  p.piece_stride =
      static_cast<int>(p.chunk_bytes < kBulkStageBytes ? p.chunk_bytes : kBulkStageBytes);
  p.pieces_per_stage = kBulkStageBytes / p.piece_stride;
  p.total_pieces = p.total_units * p.parts_per_unit;
  p.num_batches = (p.total_pieces + p.pieces_per_stage - 1) / p.pieces_per_stage;
}

// CTAs a launch uses: num_blocks, but never more than there are batches.
inline int bulk_grid(const BulkParams& p, int num_blocks) {
  return static_cast<int>(p.num_batches < num_blocks ? p.num_batches : num_blocks);
}

// Size the ring of a launch on `grid` CTAs: as many stages as a CTA has rounds (at most
// kBulkStages) and the bytes a batch's pieces take, rounded up to kBulkStageAlign.
inline void bulk_ring(BulkParams& p, int grid) {
  const int64_t rounds = (p.num_batches + grid - 1) / grid;
  p.stages = static_cast<int>(rounds < kBulkStages ? rounds : kBulkStages);
  const int64_t pieces = p.total_pieces < p.pieces_per_stage ? p.total_pieces : p.pieces_per_stage;
  const int64_t used = pieces * p.piece_stride;
  p.stage_bytes =
      static_cast<int>((used + kBulkStageAlign - 1) / kBulkStageAlign * kBulkStageAlign);
}

// Dynamic shared memory of a launch: its ring.
inline size_t bulk_shared_bytes(const BulkParams& p) {
  return static_cast<size_t>(p.stages) * static_cast<size_t>(p.stage_bytes);
}

// Round r of a CTA: its ring slot and the phase parity its mbarriers complete with.
__host__ __device__ __forceinline__ int bulk_slot(int64_t round, int stages) {
  return static_cast<int>(round % stages);
}
__host__ __device__ __forceinline__ uint32_t bulk_parity(int64_t round, int stages) {
  return static_cast<uint32_t>((round / stages) & 1);
}

// The first piece of batch `batch` and how many pieces it holds (the last batch may be short).
__host__ __device__ __forceinline__ int64_t bulk_batch_pieces(const BulkParams& p, int64_t batch,
                                                              int64_t* first) {
  *first = batch * p.pieces_per_stage;
  const int64_t left = p.total_pieces - *first;
  return left < p.pieces_per_stage ? left : p.pieces_per_stage;
}

// Resolve `piece`: false when its pair is out of range (then *counted is true for the first part
// of the unit, so a unit is counted once); else its source and destination addresses and size.
template <class SrcSide, class DstSide>
__host__ __device__ __forceinline__ bool locate_piece(const BulkParams& p, int64_t piece,
                                                      int64_t& src, int64_t& dst, uint32_t& bytes,
                                                      bool& counted) {
  const int64_t unit = piece / p.parts_per_unit;
  const int64_t offset = (piece - unit * p.parts_per_unit) * kBulkStageBytes;
  const UnitCoords u =
      decompose_unit(unit, p.units_per_index, p.num_chunks, p.layer_begin, p.layer_count);
  const int64_t s = load_readonly(p.src_idx + u.i);
  const int64_t d = load_readonly(p.dst_idx + u.i);
  if (!pair_in_range(p.src, s, p.dst, d)) {
    counted = offset == 0;
    return false;
  }
  counted = false;
  src = SrcSide::address(p.src, u.kv, u.layer, s) + u.c * p.src.s_chunk + offset;
  dst = DstSide::address(p.dst, u.kv, u.layer, d) + u.c * p.dst.s_chunk + offset;
  const int64_t left = p.chunk_bytes - offset;
  bytes = static_cast<uint32_t>(left < kBulkStageBytes ? left : kBulkStageBytes);
  return true;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// PTX wrappers (sm_90, PTX ISA 8.0). Shared addresses are 32-bit shared-window addresses.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile(
      "{\n\t.reg .b64 state;\n\t"
      "mbarrier.arrive.release.cta.shared::cta.b64 state, [%0];\n\t}" ::"r"(bar)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}
__device__ __forceinline__ void bulk_load(uint32_t dst_smem, int64_t src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst_smem),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void bulk_store(int64_t dst, uint32_t src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(src_smem), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// All but the newest group have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read_all_but_newest() {
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}
// Every group has completed (its writes are done).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#endif

template <class SrcSide, class DstSide>
__global__ void __launch_bounds__(kBulkThreads)
    transfer_bulk_kernel(const __grid_constant__ BulkParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char ring[];  // p.stages x p.stage_bytes (bulk_ring)
  __shared__ alignas(8) uint64_t full[kBulkStages];
  __shared__ alignas(8) uint64_t empty[kBulkStages];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kBulkStages; ++s) {  // all of them: unused ones cost 16 bytes
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), 1);
    }
    mbar_fence_init();
  }
  __syncthreads();
  // Warp 0 loads, warp 1 stores; the lanes of each take a batch's pieces k = lane, lane + 32, ...
  // (a stage of 256-byte pieces holds 32: one per lane), so addresses are computed 32 at a time.
  const int lane = threadIdx.x & 31;
  const bool loader = threadIdx.x < 32;
  const uint32_t ring_base = smem_addr(ring);
  int64_t round = 0;
  for (int64_t batch = blockIdx.x; batch < p.num_batches; batch += gridDim.x, ++round) {
    const int slot = bulk_slot(round, p.stages);
    const uint32_t parity = bulk_parity(round, p.stages);
    const uint32_t full_bar = smem_addr(&full[slot]);
    const uint32_t stage = ring_base + slot * p.stage_bytes;
    int64_t first = 0;
    const int64_t count = bulk_batch_pieces(p, batch, &first);
    if (loader) {
      if (round >= p.stages) {
        mbar_wait(smem_addr(&empty[slot]), parity ^ 1);
      }
      for (int k = lane; k < count; k += 32) {
        int64_t src = 0;
        int64_t dst = 0;
        uint32_t bytes = 0;
        bool counted = false;
        if (locate_piece<SrcSide, DstSide>(p, first + k, src, dst, bytes, counted)) {
          mbar_expect_tx(full_bar, bytes);  // before its own load: the count never completes early
          bulk_load(stage + k * p.piece_stride, src, bytes, full_bar);
        } else if (counted && p.oob_count != nullptr) {
          atomicAdd(p.oob_count, 1);
        }
      }
      __syncwarp();  // every lane's expect_tx is in before the stage's one arrival
      if (lane == 0) {
        mbar_arrive(full_bar);
      }
    } else {
      mbar_wait(full_bar, parity);
      for (int k = lane; k < count; k += 32) {
        int64_t src = 0;
        int64_t dst = 0;
        uint32_t bytes = 0;
        bool counted = false;
        if (locate_piece<SrcSide, DstSide>(p, first + k, src, dst, bytes, counted)) {
          bulk_store(dst, stage + k * p.piece_stride, bytes);
        }
      }
      // Bulk groups are per thread: each lane commits its stores and waits for its older groups to
      // have read their stage; then the warp's one arrival frees the previous round's slot.
      bulk_commit();
      bulk_wait_read_all_but_newest();
      __syncwarp();
      if (round >= 1 && lane == 0) {
        mbar_arrive(smem_addr(&empty[bulk_slot(round - 1, p.stages)]));
      }
    }
  }
  if (!loader) {
    bulk_wait_all();
  }
#elif defined(__CUDA_ARCH__)
  // Compiled for an older arch: this image runs only when an sm_90+ GPU JIT-compiles its PTX (e.g.
  // a "8.0+PTX" build), and a body that copied nothing would report success. Fail the launch
  // instead (cudaErrorLaunchFailure at the next sync); KernelBackend never launches such an image
  // (bulk_image_versions).
  __trap();
#endif
}

// The one launcher: `p` is complete (bulk_plan and bulk_ring for `grid` applied).
template <class SrcSide, class DstSide>
cudaError_t launch_transfer_bulk_kernel(const BulkParams& p, int grid, cudaStream_t stream) {
  transfer_bulk_kernel<SrcSide, DstSide><<<grid, kBulkThreads, bulk_shared_bytes(p), stream>>>(p);
  HICACHE_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace hicache
