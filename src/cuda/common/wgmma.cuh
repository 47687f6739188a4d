// src/cuda/common/wgmma.cuh - warpgroup tensor-core helpers (wgmma, sm_90a only): shared-memory
// matrix descriptors, the instruction shapes the MLA and indexer kernels use, and their fences.
//
// Shared-memory operands use the 128-byte swizzle: a matrix is stored as column blocks of 64 16-bit
// elements, bf16 or f16 (128 bytes per row), each block's rows contiguous, and the 16-byte chunk c of
// row r stored at chunk c ^ (r % 8). Every block starts on a 1024-byte boundary. K-major operands
// (A and B of S = Q K^T) step through k by moving the start address 32 bytes inside a row; the
// N-major B of O = P V (the same K tile read token by token) steps 16 tokens (2048 bytes) at a time.
//
// On targets other than sm_90a the instructions compile to a trap and the fences to nothing: a
// launcher must know that the library holds sm_90a code and that the device is sm_90 before it
// chooses a kernel that uses them (wgmma_kernels_enabled in cuda_check.hpp).
#pragma once

#include <cstdint>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/mma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LKV_WGMMA 1
#else
#define LKV_WGMMA 0
#endif

namespace latentkv::cuda::wgmma {

inline constexpr int kSwizzleRowBytes = 128;
inline constexpr int kSwizzleAtomBytes = 1024;  // 8 rows of 128 bytes

// Byte offset of 16-byte chunk `chunk` (0-7) of row `row` inside a 128-byte-swizzled column block.
__host__ __device__ constexpr int swizzled_chunk_offset(int row, int chunk) {
  return row * kSwizzleRowBytes + ((chunk ^ (row % 8)) * 16);
}

// Descriptor of a 128-byte-swizzled shared-memory matrix starting at `p`. lbo / sbo in bytes:
// K-major: sbo = distance between groups of 8 rows (lbo unused); N-major: lbo = distance between
// column blocks of 64 elements, sbo = distance between groups of 8 k (rows).
__device__ __forceinline__ std::uint64_t desc_sw128(const void* p, std::uint32_t lbo, std::uint32_t sbo) {
  const std::uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFFu) >> 4) | (static_cast<std::uint64_t>((lbo >> 4) & 0x3FFFu) << 16) |
         (static_cast<std::uint64_t>((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}
// The same descriptor moved by `bytes` (a multiple of 16, staying inside shared memory).
__device__ __forceinline__ std::uint64_t desc_advance(std::uint64_t desc, std::uint32_t bytes) {
  return desc + (bytes >> 4);
}

// Orders this thread's earlier register accesses before the warpgroup's next wgmma.
__device__ __forceinline__ void fence() {
#if LKV_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#if LKV_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most kPending committed groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void wait() {
#if LKV_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Orders this thread's ordinary shared-memory stores before the tensor cores read them (each writing
// thread runs it before the barrier that publishes the data): the async-proxy fence that
// bulk::fence_for_copy also puts before a bulk copy overwrites what threads read.
__device__ __forceinline__ void fence_shared_for_async() {
#if LKV_WGMMA
  bulk::fence_for_copy();
#endif
}
// Keeps the compiler from moving accesses of an accumulator across wgmma issue and wait.
template <int kN>
__device__ __forceinline__ void fence_registers(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Element types of the two instruction shapes: bf16 or f16 (both operands the same), f32 accumulate.
enum class Type { kBf16, kF16 };

// D (+)= A B for one m64n64k16 step, A and B from shared memory (both K-major, 128-byte swizzle);
// scale_d = 0 starts D from zero. D: warp w of the warpgroup holds rows 16w + lane/4 (+8), columns
// 8i + 2 (lane % 4) (+1) in d[4i .. 4i + 3], as mma.m16n8 accumulators side by side.
template <Type kType = Type::kBf16>
__device__ __forceinline__ void mma_m64n64k16_ss(float (&d)[32], std::uint64_t a_desc, std::uint64_t b_desc,
                                                 int scale_d) {
#if LKV_WGMMA
#define LKV_WGMMA_M64N64K16(TYPE)                                                                              \
  asm volatile(                                                                                               \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                           \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {"                                          \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                 \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),       \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])  \
      : "l"(a_desc), "l"(b_desc), "r"(scale_d))
  if constexpr (kType == Type::kBf16) {
    LKV_WGMMA_M64N64K16("bf16");
  } else {
    LKV_WGMMA_M64N64K16("f16");
  }
#undef LKV_WGMMA_M64N64K16
#else
  (void)d, (void)a_desc, (void)b_desc, (void)scale_d;
  __trap();
#endif
}

// D += A B for one m64n128k16 step: A (64 x 16) from registers in the mma.m16n8k16 fragment layout
// (warp w of the warpgroup holds rows 16w .. 16w + 15), B from shared memory N-major (128-byte
// swizzle, imm-trans-b = 1). D as in mma_m64n64k16_ss, 16 column groups of 8.
template <Type kType = Type::kBf16>
__device__ __forceinline__ void mma_m64n128k16_rs(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t b_desc) {
#if LKV_WGMMA
#define LKV_WGMMA_M64N128K16(TYPE)                                                                                 \
  asm volatile(                                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                                 \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                                             \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                    \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                          \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                           \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),           \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),     \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),   \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),   \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),   \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),   \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),   \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc))
  if constexpr (kType == Type::kBf16) {
    LKV_WGMMA_M64N128K16("bf16");
  } else {
    LKV_WGMMA_M64N128K16("f16");
  }
#undef LKV_WGMMA_M64N128K16
#else
  (void)d, (void)a, (void)b_desc;
  __trap();
#endif
}

// D (+)= A B for one m64nNk16 f16 step, N = 8, 16 or 32: A (64 x 16) from registers in the
// mma.m16n8k16 fragment layout (warp w of the warpgroup holds rows 16w .. 16w + 15), B from shared
// memory K-major (128-byte swizzle); scale_d = 0 starts D from zero. D as in mma_m64n64k16_ss, N / 8
// column groups of 8.
template <int kN>
__device__ __forceinline__ void mma_m64nNk16_rs_f16(float (&d)[kN / 2], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                                                    int scale_d) {
  static_assert(kN == 8 || kN == 16 || kN == 32, "instantiated for 8, 16 and 32 columns");
#if LKV_WGMMA
  if constexpr (kN == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d));
  } else if constexpr (kN == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d));
  }
#else
  (void)d, (void)a, (void)b_desc, (void)scale_d;
  __trap();
#endif
}

}  // namespace latentkv::cuda::wgmma
