// Shared-memory staging for the kernels of kernels/cuda/: cp.async, mbarriers,
// TMA loads of the paged pool's pages, the 128-byte-swizzle panel layout, and
// EncodePoolMap (defined in prefill.cu). Include from .cu files only.
#ifndef TANDEM_KERNELS_CUDA_ASYNC_COPY_CUH_
#define TANDEM_KERNELS_CUDA_ASYNC_COPY_CUH_

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/launch.h"

namespace tandem::kernels::cuda::internal {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; src_bytes 0 fills the destination with zeros.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

template <typename T>
__device__ __forceinline__ uint32_t Pack2(float x, float y) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// The wgmma kernel's shared layout (the canonical 128-byte-swizzle layout):
// a tile of R rows x kD elements is stored as kD/64 "panels" of 64 columns;
// a panel is R rows of 128 bytes, and 16-byte chunk c of row r sits at chunk
// c ^ (r & 7). Every panel starts 1024-byte aligned. Q is stored as one
// 64-row tile per warpgroup.
template <int kD>
__device__ __forceinline__ uint32_t PanelOffset(int rows_per_tile, int r, int ch) {
  return static_cast<uint32_t>((ch >> 3) * rows_per_tile * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

// mbarrier helpers (shared::cta, 64-bit barrier words).
__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued so far has landed.
__device__ __forceinline__ void MbarArriveOnCpAsync(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// mbarrier arrival that also expects `bytes` of TMA transactions.
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One TMA box of the paged pool's tensor map (coordinates: element in the
// head dimension, slot, KV head, K|V, block) into shared memory at `dst`,
// completing on `bar`.
__device__ __forceinline__ void TmaLoadBox(uint32_t dst, const CUtensorMap* map, int c0, int slot, int head, int kv,
                                           int block, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(slot), "r"(head), "r"(kv), "r"(block), "r"(bar)
      : "memory");
}

// The layer's paged pool as a 5-D TMA tensor (element in the head
// dimension, slot, KV head, K|V, block), boxes of 64 elements x `box_rows`
// slots (a page or a part of one), 128-byte swizzle (the panel layout
// above). False where the driver has no encoder or the strides do not fit
// TMA's rules (callers then use cp.async).
// l2_promotion: 0 none, 1 64 B, 2 128 B, 3 256 B (the default). kv_box 2:
// a box spans the page's K and V (landing K rows, then V rows). split_rows:
// each head_dim row is seen as head_dim / 64 rows of 128 bytes (its
// 64-column halves, in memory order), so one box of box_rows x head_dim/64
// such rows reads a page's rows whole, front to back.
bool EncodePoolMap(const AttnArgs& a, int box_rows, CUtensorMap* map, int l2_promotion = 3, int kv_box = 1,
                   bool split_rows = false);

// Four 8x8 b16 matrices from shared memory (lanes 8i..8i+7 address matrix i's
// rows), plain or transposed.
__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

}  // namespace tandem::kernels::cuda::internal

#endif  // TANDEM_KERNELS_CUDA_ASYNC_COPY_CUH_
