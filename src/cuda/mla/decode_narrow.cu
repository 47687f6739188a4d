// Dense MLA decode for few query rows (q_len x heads <= 16: glm5 and deepseek-v3.2 at tp 8 and 16)
// over the fp8 cache: the memory-bound case, built to move as few instructions per token as possible.
//
// The products are transposed so that the tokens, not the 8 or 16 query rows, fill the 16-row side
// of the tensor-core MMA (m16n8k16, f16 in, f32 accumulate):
//   scores  S^T[token, row] = K Q^T   A = K from the raw fp8 bytes, B = Q (f16, scaled per row)
//   output  O^T[dim, row]  += V^T P'^T A = V^T from the raw fp8 bytes, B = P' (f16, hi + lo)
// fp8 codes become f16 with one cvt per two codes, exactly; each token's four fp8 scales stay out of
// the products: they weight the per-block score partials, and fold into P' for the output block.
// (V^T's codes by integer bit moves instead of cvt made the kernel slower in proportion to the codes
// moved: profiled at B 64 x 8K (4 warps per scheduler) it is bound by its dependent chains, not by
// the conversion pipe - docs/benchmarks.md, seventeenth session of 2026-12-02.)
//
// Work of one CTA (4 warps) on a 32-token tile staged raw (656 B/token), 2 or 3 deep, by the copy
// engine (a dense decode's runs of consecutive slots, one bulk copy each) or by cp.async:
//   scores:  warp w: tokens [16 (w % 2), +16), latent blocks {0,1} (w < 2) or {2,3}, and the rope
//            (at 8 rows half of its dims in each warp, at 16 rows all of them in warps 2 and 3),
//            masked tokens written as -inf; the two halves' partials meet in shared memory
//   softmax: every warp, the whole tile, in registers: lane (r, c) takes row r and the tokens its
//            output B fragments need, so P never goes back to shared memory and the running max and
//            sum live in registers (each warp holds the same values)
//   output:  warp w: the 128 dims of fp8 scale block w
// Two CTA barriers per tile: the tile is staged, and the score partials are complete. (Per-stage
// "empty" mbarriers in place of the first, in the bulk instances, were slower: H 8 B 64 x 8K 95.6 ->
// 96.6 us, H 16 135.8 -> 140.2 - docs/benchmarks.md, twenty-third session.)
// (8 warps per CTA below kShallowFromBatch requests, each scoring one latent block and writing 64
// output dims, was slower on every dense decode shape measured, even at equal CTAs: B 1 x 32K, 256
// CTAs either way, 18.5 -> 20.2 us. The sparse decode at B 1 measured the same. At 8 rows with 3
// stages 8-warp CTAs fit 2 per SM, not 3 - docs/benchmarks.md, 2026-12-03.)
// (Nor did one CTA per SM of 4 groups of 4 warps, each group running this loop on its own shared
// memory and taking its split's tiles from a shared counter, so that the 4 CTAs that otherwise share
// an SM, and end their loops up to 14 us apart, end together: H 8 B 64 x 8K 96.0 -> 98.8 us, B 48
// 77.9 -> 97.2 (2 splits, 96 CTAs), B 32 57.2 -> 56.4 - docs/benchmarks.md, twenty-fourth session.)
// (Nor did claims of a request's last tiles from a counter per request: 3% back over the same loop
// without them, but the tile positions they need cost 4%, so H 8 B 64 x 8K 97.3 -> 98.4 us; nor did
// uneven split shares by dispatch order - docs/benchmarks.md, twenty-fifth session.)
// (Nor did tails of every piece, claimed across requests from a counter in the workspace by the CTAs
// done with their own piece: its instance ran 6.5% slower before claiming anything, and a tail took
// 10-16 us from its claim to the grid barrier, so H 8 B 64 x 8K 98.4 -> 113.5-117.5 us whatever the
// share - docs/benchmarks.md, thirty-seventh session.)
// (Nor did warps that each own 16-token tiles, with their own stages, softmax and all 512 output
// dims, and no CTA barrier in the loop: about half the instructions per token, 2 CTAs per SM at 251
// registers. H 8 B 64 x 8K 98.8 against 102.5 us on one instance, 101.6 against 101.2 on another;
// B 1 x 32K 19.8 against 18.6 - docs/benchmarks.md, twenty-second session.)
// With splits, each CTA writes its split's partial rows and lse. With few splits per request (many
// requests) and the whole grid resident at once (the plan sizes it to one wave), the kernel is
// launched cooperatively, and after one grid barrier each CTA merges a slice of its request's
// outputs over all the splits (merge_splits): no combine kernel, and no scratch that would have to
// be zeroed. Otherwise decode.cu's combine kernel merges them. (A barrier per request instead, on
// a word per request in a workspace the caller keeps zeroed, left the dense and sparse decodes
// where they were: the last request still ends last - docs/benchmarks.md, twenty-seventh session.
// Nor did each request's splits as one thread-block cluster, merged through distributed shared
// memory with no partials in global memory and no grid barrier: slower on every shape, H100, sparse
// H 8 B 64 50.2 -> 55.8 us, sparse H 16 B 64 58.0 -> 74.0, and in place of the balanced grid dense
// H 8 B 64 x 8K 127.3 -> 163.3 - docs/benchmarks.md, sixty-third session.)
// A dense decode merged in the kernel (on bulk copies) hands its CTAs out by the requests' lengths
// rather than num_splits to each (the balanced grid, balanced_piece below): in a batch of mixed
// lengths an even grid waits for the pieces of its longest request. H200, glm5 tp 8, B 64 of 1K to
// 16K tokens, even / balanced: 150.8 / 115.1 us (H 16: 246.5 / 176.0); at equal lengths, where both
// cut the same pieces, the balanced grid's prologue costs 1-2% (B 64 x 8K 95.4 / 96.6 us, H 16
// 137.2 / 138.3) - docs/benchmarks.md, twenty-sixth session.
// A dense prefill on few heads runs here in groups of new tokens (up to 16 rows: DecodeGroups in
// launch.hpp) where the wgmma kernel does not serve it (sm_89, sm_100, sm_120, an sm_90 build
// without sm_90a code, LATENTKV_MLA_KERNEL=mma).
// K's dims are read in a permuted order (16 contiguous codes per thread cover four k-steps); Q is
// laid out to match, so the sum is unchanged. V^T pairs two tokens per register with byte permutes,
// and the output dims are permuted the same way and put back in place when written.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/chained_launch.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/mma.cuh"
#include "cuda/common/register_cap.cuh"
#include "cuda/mla/decode_common.cuh"
#include "latentkv/error.hpp"

namespace latentkv::cuda::mla {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = 32;          // tokens per tile
constexpr int kTokenBytes = 656;   // fp8 main-cache entry
constexpr int kTokenChunks = kTokenBytes / 16;
constexpr int kStageBytes = kTile * kTokenBytes;
constexpr int kCopyLanes = 8;                    // threads per token when a tile is copied in
constexpr int kCopyTokens = kThreads / kCopyLanes;  // tokens per pass of all the threads
// Tiles in flight per CTA: 3 (the current one and two ahead) when few requests share the GPU and
// each CTA streams a short split (latency counts), 2 when the batch alone fills the GPU (more CTAs
// fit per SM in less shared memory, and keep as many bytes in flight). H200, glm5 tp 8, 3 / 2 stages
// (2026-12-02): B 64 x 8K 108.9 / 102.8 us, B 16 x 8K 38.3 / 39.0, B 4 x 32K 38.3 / 39.3, but one
// request B 1 x 32K 18.7 / 18.2 and B 1 x 256K 60.3 / 59.6 (a rule for B 1 alone was not worth it).
constexpr int kShallowFromBatch = 32;
constexpr int kQStride = 1040;     // bytes per f16 query row (1024 + 16: conflict-free 16-byte reads)
constexpr int kRopeStride = 144;   // bytes per bf16 rope row (128 + 16)
constexpr int kSStride = 40;       // floats per row of score partials (conflict-free 8-byte reads)
constexpr int kOutStride = 516;    // floats per output row staged at the end (512 + 4)

template <int kNt, int kStages>
struct NarrowSmem {
  static constexpr int kRows = 8 * kNt;
  static constexpr int kStage = 0;                                   // u8  [kStages][kTile * 656]
  static constexpr int kQ = kStage + kStages * kStageBytes;                // f16 [kRows][kQStride / 2]
  static constexpr int kQRope = kQ + kRows * kQStride;               // bf16 [kRows][kRopeStride / 2]
  static constexpr int kSPart = kQRope + kRows * kRopeStride;        // f32 [2][kRows][kSStride]
  static constexpr int kRowQScale = kSPart + 4 * 2 * kRows * kSStride;  // f32 [kRows], 2^-e of the f16 queries
  static constexpr int kSlots = kRowQScale + 4 * kRows;              // i32 [kStages][kTile]
  static constexpr int kPiece = kSlots + 4 * kStages * kTile;        // i32 [5]: the CTA's Piece (balanced grid)
  static constexpr int kBars = (kPiece + 20 + 7) / 8 * 8;            // u64 [kStages] (bulk copies)
  static constexpr int kBytes = kBars + 8 * kStages;
  static_assert(kBytes <= 99 * 1024, "must fit the 99 KB per block of sm_89 and sm_120");
  static_assert(kRows * kOutStride * 4 <= kStages * kStageBytes, "the output rows are staged over the tiles");
};

__device__ __forceinline__ uint4 lds128(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ std::uint32_t lds32(const void* p) { return *reinterpret_cast<const std::uint32_t*>(p); }
__device__ __forceinline__ uint2 lds64(const void* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ float token_scale(const std::uint8_t* kv, int token, int block) {
  return reinterpret_cast<const float*>(kv + token * kTokenBytes + 512)[block];
}
// The scales of blocks `block` and `block` + 1 (`block` even) of a staged token, one 8-byte load.
__device__ __forceinline__ float2 token_scale_pair(const std::uint8_t* kv, int token, int block) {
  return *reinterpret_cast<const float2*>(kv + token * kTokenBytes + 512 + 4 * block);
}

// The most splits merged in the kernel. With many splits (one long request) a grid barrier over
// that many CTAs and their small slices cost more than the combine kernel, whose launch overlaps the
// decode's tail. H200, in-kernel merge against the combine in the same run: H 8 B 64 x 8K (8 splits)
// 103.9 / 107.4 us, H 16 B 64 (6) 142.8 / 149.5, sparse H 8 B 64 (8) 40.0 / 43.9; but B 1 x 32K (256)
// 19.8 / 19.0, B 1 x 256K (396) 63.0 / 60.2, sparse B 1 (64) 10.3 / 9.7.
constexpr int kMergeMostSplits = 16;

// The in-kernel merge (merge_splits) over S splits of a request's R rows. Its outputs are R x 128
// units of 4 dims (one float4 of a partial row); split s's CTA takes units [s U / S, (s + 1) U / S),
// U = 128 R, and stages their partials from all S splits in shared memory: at most ceil(U / S) x S
// float4, plus one reduction float4 per thread and a weight per split for each row it touches.
struct MergeShape {
  int units, most_units, most_rows;
  __host__ __device__ constexpr MergeShape(int splits, int rows)
      : units(128 * rows), most_units((units + splits - 1) / splits), most_rows((most_units + 127) / 128 + 1) {}
};
__host__ __device__ constexpr std::size_t merge_bytes(int splits, int rows) {
  const MergeShape m(splits, rows);
  return 16 * (static_cast<std::size_t>(m.most_units) * splits + kThreads) + 4 * static_cast<std::size_t>(m.most_rows) * (splits + 1);
}
// The most of any merge of 2 to kMergeMostSplits splits (a balanced grid's requests have any count).
constexpr std::size_t most_merge_bytes(int rows) {
  std::size_t most = 0;
  for (int s = 2; s <= kMergeMostSplits; ++s) most = merge_bytes(s, rows) > most ? merge_bytes(s, rows) : most;
  return most;
}

// A CTA's share of the call: piece j of request b's `count` pieces (its tokens cut into `count`
// chunks of whole tiles, split_range), whose partial rows (count > 1) go to workspace slot
// first + j x stride: slot x x batch + y of CTA (x, y) in an even grid (split-major, as the combine
// reads them), the CTA's own index in a balanced one, which also knows the request's length (len;
// -1: not read yet). b = -1: a CTA of a balanced grid left without work.
struct Piece {
  int b, j, count, first, stride, len;
  __device__ std::int64_t slot_row(int piece, int row, int rows) const {
    return (static_cast<std::int64_t>(first) + static_cast<std::int64_t>(piece) * stride) * rows + row;
  }
};

// The balanced grid (narrow_kernel's kBalanced: the in-kernel merge of a dense decode). An even grid cuts
// every request into num_splits pieces, so in a batch of mixed lengths the pieces of the longest
// take the longest and the call waits for them. Here the grid's G CTAs, in dispatch order (c = y x
// num_splits + x), go to the requests by length: request b, of tiles_b 32-token tiles (T over the
// batch, B requests), takes 1 + floor(tiles_b (G - B) / T) consecutive CTAs, at most
// kMergeMostSplits, so that no piece holds much more than T / (G - B) tiles whatever the lengths
// (equal lengths: num_splits pieces each, the even grid). Every CTA works it out from the lengths,
// kBalancedPerThread requests a thread at most (a load each, a block sum, a block scan; the
// products in double, exact, and the quotient's floor never above the exact one, so the counts sum
// to at most G), and puts its piece in `out` (5 ints) for the epilogue; `scratch` takes 8 doubles.
// Larger batches, sparse decodes (every row reads index_cols tokens) and calls merged by
// decode.cu's combine keep the even grid.
constexpr int kBalancedPerThread = 4;
constexpr int kBalancedMostBatch = kBalancedPerThread * kThreads;
__device__ Piece balanced_piece(const DecodeArgs& a, double* scratch, int* out) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int ctas = a.num_splits * a.batch;
  const int c = static_cast<int>(blockIdx.y) * a.num_splits + static_cast<int>(blockIdx.x);  // dispatch order
  int len[kBalancedPerThread];
  double tiles[kBalancedPerThread], sum = 0.0;
#pragma unroll
  for (int k = 0; k < kBalancedPerThread; ++k) {  // this thread's requests tid x 4 + k
    const int b = tid * kBalancedPerThread + k;
    len[k] = b < a.batch ? request_length(a, b) : -1;
    tiles[k] = len[k] > 0 ? static_cast<double>((len[k] + kTile - 1) / kTile) : 0.0;
    sum += tiles[k];
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) scratch[warp] = sum;
  __syncthreads();
  const double total = scratch[0] + scratch[1] + scratch[2] + scratch[3];
  const double spare = ctas - a.batch;
  int pieces[kBalancedPerThread], mine = 0;
#pragma unroll
  for (int k = 0; k < kBalancedPerThread; ++k) {
    const double more = total > 0.0 ? floor(tiles[k] * spare / total) : 0.0;
    pieces[k] = len[k] >= 0 ? 1 + static_cast<int>(fmin(more, kMergeMostSplits - 1.0)) : 0;
    mine += pieces[k];
  }
  int first = mine;  // inclusive scan over the warp, then over the warps before, then exclusive
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, first, off);
    if (lane >= off) first += v;
  }
  if (lane == 31) scratch[4 + warp] = first;
  if (tid == 0) out[0] = -1;
  __syncthreads();
  for (int w = 0; w < warp; ++w) first += static_cast<int>(scratch[4 + w]);
  first -= mine;
#pragma unroll
  for (int k = 0; k < kBalancedPerThread; ++k) {
    if (c >= first && c < first + pieces[k]) {
      out[0] = tid * kBalancedPerThread + k;
      out[1] = c - first;
      out[2] = pieces[k];
      out[3] = first;
      out[4] = len[k];
    }
    first += pieces[k];
  }
  __syncthreads();
  return {out[0], out[1], out[2], out[3], 1, out[4]};
}

// The split combine inside the kernel, after the grid barrier: the CTA of piece j of request b
// merges its units over the request's S pieces (o = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max
// lse), as decode.cu's combine_kernel), and writes the lse of the rows whose first unit it owns.
// One round trip to L2: every partial it needs goes out at once by cp.async (which reads past L1,
// so other SMs' writes are seen) while the warps load the rows' lse; the sums then run from shared
// memory, `groups` threads per unit sharing the pieces when the CTA has few units.
__device__ void merge_splits(const DecodeArgs& a, const Piece& piece, unsigned char* scratch) {
  const int splits = piece.count, split = piece.j, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const MergeShape shape(splits, a.rows);
  const int q0 = static_cast<int>(static_cast<std::int64_t>(split) * shape.units / splits);
  const int units = static_cast<int>(static_cast<std::int64_t>(split + 1) * shape.units / splits) - q0;
  if (units == 0) return;  // more splits than units: nothing left for this CTA
  const std::int64_t row0 = static_cast<std::int64_t>(piece.b) * a.rows;  // of o and lse
  const std::int64_t part0 = static_cast<std::int64_t>(piece.first) * a.rows;           // piece 0's partial rows
  const std::int64_t part_stride = static_cast<std::int64_t>(piece.stride) * a.rows;  // from one piece's to the next
  const int first_row = q0 / 128, rows = (q0 + units - 1) / 128 - first_row + 1;
  float4* part_s = reinterpret_cast<float4*>(scratch);  // [splits][units]
  float4* red_s = part_s + static_cast<std::size_t>(splits) * units;  // [kThreads]
  float* weight_s = reinterpret_cast<float*>(red_s + kThreads);        // [rows][splits]
  float* total_s = weight_s + rows * splits;                            // [rows] sums of the weights
  // Element i = s x units + j; thread tid's (s, j) step by kThreads without a division per element.
  const int step_s = kThreads / units, step_j = kThreads % units;
  for (int i = tid, s = tid / units, j = tid % units; i < splits * units; i += kThreads) {
    const int q = q0 + j;
    cp_async_16(part_s + i, a.o_part + (s * part_stride + part0 + q / 128) * 512 + 4 * (q % 128), 16);
    s += step_s, j += step_j;
    if (j >= units) s += 1, j -= units;
  }
  cp_async_commit();
  for (int t = warp; t < rows; t += kThreads / 32) {
    const int row = first_row + t;
    float* w = weight_s + t * splits;
    float m = -INFINITY;
    for (int s = lane; s < splits; s += 32) {
      w[s] = __ldcg(&a.lse_part[s * part_stride + part0 + row]);
      m = lse_max(m, w[s]);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = lse_max(m, __shfl_xor_sync(0xffffffffu, m, off));
    float total = 0.0f;
    for (int s = lane; s < splits; s += 32) {
      w[s] = split_weight(w[s], m);
      total += w[s];
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
    if (lane == 0) {
      total_s[t] = total;
      if (128 * row >= q0) a.lse[row0 + row] = merged_lse(m, total);  // the row's first unit is this CTA's
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  const int groups = max(1, kThreads / units);
  const auto sum_of = [&](int j, int g) {
    const float* w = weight_s + ((q0 + j) / 128 - first_row) * splits;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = g; s < splits; s += groups) add_scaled(acc, w[s], part_s[s * units + j]);
    return acc;
  };
  const auto write = [&](int j, const float4& acc) {
    const int q = q0 + j;
    reinterpret_cast<uint2*>(a.o + (row0 + q / 128) * 512)[q % 128] = merged_bf16x4(acc, total_s[q / 128 - first_row]);
  };
  if (groups == 1) {
    for (int j = tid; j < units; j += kThreads) write(j, sum_of(j, 0));
    return;
  }
  if (tid < groups * units) red_s[tid] = sum_of(tid % units, tid / units);
  __syncthreads();
  if (tid < units) {
    float4 acc = red_s[tid];
    for (int g = 1; g < groups; ++g) add(acc, red_s[g * units + tid]);
    write(tid, acc);
  }
}

// Registers capped so that the CTAs the shared memory allows per SM also fit the register file
// (register_cap.cuh): on sm_90, 4 for 8 rows at 2 stages (128 registers), 3 for 8 rows at 3 stages
// and for 16 rows at 2, 2 for 16 rows at 3; on sm_89 and sm_120 (100 KB per SM) one, which keeps
// those instances from spilling. On sm_90 this moved the 8-row 3-stage instances' cap from 128
// registers (4 CTAs, more than fit) to 168 (they take 134-140); against the fixed caps before it, on
// an H100 in the same call, no shape timed (glm5 tp 8 B 1 x 32K and 256K, B 64 x 8K, tp 4 B 64,
// sparse B 1 and B 64, dsa_decode B 1, the step) was slower by more than 0.4% (docs/benchmarks.md,
// sixty-fifth session).
// kGrouped: the requests are groups of a dense prefill's new tokens (DecodeGroups, decode_common.cuh):
// request b's query rows are those of its spans[b].y tokens, from row spans[b].x * H of q, o and lse
// on; its splits are merged by decode.cu's combine (which knows the groups' rows).
template <int kNt, int kStages, bool kChecks, bool kGrouped, bool kBulk, bool kBalanced>
__global__ void
__launch_bounds__(kThreads, ctas_per_sm_cap(kNt == 1 ? 4 : 5 - kStages, NarrowSmem<kNt, kStages>::kBytes))
    narrow_kernel(const DecodeArgs a, const FaultSink fault, const int2* spans) {
  static_assert(!(kChecks && kGrouped), "grouped prefills are checked before the decode (prefill_rows.hpp)");
  static_assert(!(kGrouped && kBalanced), "a grouped prefill's splits are merged by decode.cu's combine");
  using Smem = NarrowSmem<kNt, kStages>;
  constexpr int kRows = Smem::kRows;
  extern __shared__ __align__(16) unsigned char smem[];
  std::uint8_t* stages = smem + Smem::kStage;
  unsigned char* q_s = smem + Smem::kQ;
  unsigned char* q_rope_s = smem + Smem::kQRope;
  float* s_part = reinterpret_cast<float*>(smem + Smem::kSPart);
  float* row_qscale = reinterpret_cast<float*>(smem + Smem::kRowQScale);
  std::int32_t* slot_s = reinterpret_cast<std::int32_t*>(smem + Smem::kSlots);
  std::uint64_t* bars = reinterpret_cast<std::uint64_t*>(smem + Smem::kBars);
  std::int32_t* piece_s = reinterpret_cast<std::int32_t*>(smem + Smem::kPiece);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int r = lane / 4, c = lane % 4;
  // The queries of request `rows` into registers (rows past its count are zero).
  constexpr int kRowsPerWarp = kRows / 4;  // rows warp + 4 i
  uint4 q_latent[kRowsPerWarp][2], q_rope[kRowsPerWarp];
  const auto load_queries = [&](const RequestRows& rows) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int row = warp + 4 * i;
      q_latent[i][0] = q_latent[i][1] = q_rope[i] = make_uint4(0, 0, 0, 0);
      if (row < rows.count) {
        const uint4* src = reinterpret_cast<const uint4*>(a.q + (rows.origin + row) * 576);
        q_latent[i][0] = src[2 * lane];
        q_latent[i][1] = src[2 * lane + 1];
        if (lane < 8) q_rope[i] = src[64 + lane];
      }
    }
  };
  // This CTA's piece: the even grid's from the block index; the balanced grid's found before any
  // work, while the queries of the even grid's request load (its request with equal lengths), and
  // kept in shared memory, read again for the epilogue rather than held through the loop.
  const auto even_piece = [&] {
    return Piece{static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.x), a.num_splits, static_cast<int>(blockIdx.y),
                 a.batch, -1};
  };

  wait_for_previous_kernels();
  Piece work = even_piece();
  if constexpr (kBalanced) {
    load_queries(request_rows<false>(a, spans, work.b));
    work = balanced_piece(a, reinterpret_cast<double*>(s_part), piece_s);
    if (work.b < 0) {  // no work left for this CTA: it only takes part in the grid barrier
      allow_next_kernel();
      cooperative_groups::this_grid().sync();
      return;
    }
  }
  const int b = work.b, split = work.j;
  // Token t's block-table entry. The even grid finds its row from the block index, in uniform
  // registers; the balanced grid's request is no block index: at 8 rows its row's address stays in
  // a register pair through the loop, at 16 rows (where that pair spills into the loop) the address
  // is worked out again from the request each time.
  const std::int32_t* entries = kBalanced && kNt == 1 ? entry_row(a, b) : nullptr;
  const auto entry_at = [&](int t) {
    if constexpr (kBalanced && kNt == 1) return row_entry(a, entries, t);
    else return load_token_entry(a, b, t);
  };
  const RequestRows rows = request_rows<kGrouped>(a, spans, b);
  const SplitRange range = split_range<kChecks>(a, fault, b, split, work.count, kTile, work.len);
  const int len = range.len, begin = range.begin, end = range.end, num_tiles = range.num_tiles;
  // ---- the first tiles go out before the queries are staged, so that the two overlap: the
  // queries' loads, the slots of the first kStages tiles (all their entries loaded before any is
  // used), then the copies ----
  if (!kBalanced || b != static_cast<int>(blockIdx.y)) load_queries(rows);  // (the balanced grid's: unless loaded)
  int bad_token = -1;  // the last of this thread's tokens with an entry outside the pool (note_bad_entry)
  if (tid < kTile) {
    std::int32_t entry[kStages];
#pragma unroll
    for (int t = 0; t < kStages; ++t) {
      const int pos = begin + t * kTile + tid;
      entry[t] = t < num_tiles && pos < end ? entry_at(pos) : -1;
    }
#pragma unroll
    for (int t = 0; t < kStages; ++t) {
      const int pos = begin + t * kTile + tid;
      slot_s[t * kTile + tid] = t < num_tiles && pos < end ? entry_to_slot(a, pos, entry[t], bad_token) : -1;
    }
  }
  if constexpr (kBulk) {
    // Stages zeroed once, where cp.async would zero-fill each uncopied token (no slot, past the split):
    // such a token then reads as zeros, or as one this CTA staged in an earlier tile (whose scale the
    // units already hold), and meets P = 0.
    uint4* zero = reinterpret_cast<uint4*>(stages);
    for (int i = tid; i < kStages * kStageBytes / 16; i += kThreads) zero[i] = make_uint4(0, 0, 0, 0);
    if (tid == 0) {
      for (int s = 0; s < kStages; ++s) bulk::init(&bars[s], 1);
      bulk::fence_init();
    }
  }
  __syncthreads();

  // issue_copies: cp.async of tile `tile` into stage tile % kStages, as one commit group; past
  // the last tile an empty group, so that "all but the newest kStages - 2 groups have landed" always
  // means "this tile".
  // Eight threads per token (tokens tid / 8 and tid / 8 + 16), one slot read each. An entry starts
  // anywhere inside a 128-byte line (656 = 5 x 128 + 16), so thread p takes the entry's 16-byte
  // pieces that sit at position p of their line: each copy instruction of the eight then reads one
  // whole line of the entry, and an entry costs its 6 or 7 lines, not two per instruction.
  const int copy_token = tid / kCopyLanes, copy_piece = tid % kCopyLanes;
  auto issue_copies = [&](int tile) {
    if (tile < num_tiles) {
      const std::int32_t* slots = slot_s + (tile % kStages) * kTile;
      std::uint8_t* stage = stages + (tile % kStages) * kStageBytes;
#pragma unroll
      for (int pass = 0; pass < kTile / kCopyTokens; ++pass) {
        const int token = copy_token + kCopyTokens * pass;
        const std::int32_t slot = slots[token];
        const std::uint8_t* entry = a.cache + (slot >= 0 ? static_cast<std::int64_t>(slot) * kTokenBytes : 0);
        const int first = copy_piece - static_cast<int>((reinterpret_cast<std::uintptr_t>(entry) / 16) % kCopyLanes);
        const std::uint8_t* src = entry + 16 * first;  // piece `first` (from -7 to 7) of the entry, then + 8 ...
        std::uint8_t* dst = stage + token * kTokenBytes + 16 * first;
        const int bytes = slot >= 0 ? 16 : 0;  // zero-filled: an unread token's V meets P = 0, never NaN
        if (first >= 0) cp_async_16(dst, src, bytes);
#pragma unroll
        for (int i = 1; i < kTokenChunks / kCopyLanes; ++i) cp_async_16(dst + 16 * kCopyLanes * i, src + 16 * kCopyLanes * i, bytes);
        constexpr int kLast = kTokenChunks / kCopyLanes * kCopyLanes * 16;  // piece first + 40 <= 40
        if (first <= 0) cp_async_16(dst + kLast, src + kLast, bytes);
      }
    }
    cp_async_commit();
  };
  // With bulk copies (kBulk: sm_90 and later, bulk_copies()) warp 0 copies each run of consecutive
  // slots (the tile's tokens in one page) with one copy, all completing on the stage's barrier, which
  // the first thread arms with the tile's bytes; a tile with no slot completes it by a plain arrival.
  // The copies mark their lines evict-first in the L2: the cache entries are read once, and the
  // splits' partials, written while hundreds of MB more stream past and read back by the merge, had
  // better stay (the likely reason for the gain; not profiled). H200, the same call, without / with
  // the hint: H 8 B 64 x 8K 96.6, 96.8 / 95.4, 95.0 us; B 1 x 256K (the combine kernel's 396 splits)
  // 58.3, 58.5 / 57.2, 56.9; B 1 x 32K, H 16 B 64 and B 64 of 1K-16K tokens unchanged
  // (docs/benchmarks.md, thirty-seventh session). A grouped prefill's groups read their request's
  // prefix again, group after group, and keep the default policy; a prefill per new token (each a
  // request of its own over the same prefix) takes the hint, not measured with it.
  auto issue_bulk = [&](int tile) {
    if (tile >= num_tiles || warp != 0) return;
    const std::int32_t slot = slot_s[(tile % kStages) * kTile + lane];
    std::uint64_t* bar = &bars[tile % kStages];
    const std::int32_t prev = __shfl_up_sync(0xffffffffu, slot, 1);
    const bool valid = slot >= 0, cont = valid && lane > 0 && prev >= 0 && prev + 1 == slot;
    const unsigned valids = __ballot_sync(0xffffffffu, valid), conts = __ballot_sync(0xffffffffu, cont);
    bulk::fence_for_copy();  // the stage's reads (before barrier (A)) come before the copies' writes
    if (lane == 0) {
      if (valids != 0) bulk::arrive_expect(bar, static_cast<std::uint32_t>(__popc(valids) * kTokenBytes));
      else bulk::arrive(bar);
    }
    __syncwarp();
    if (valid && !cont) {
      const unsigned after = lane == 31 ? 0u : conts >> (lane + 1);
      const int run = __ffs(~after);  // this lane's token and the continuing ones after it
      constexpr bulk::L2Hint kHint = kGrouped ? bulk::L2Hint::kDefault : bulk::L2Hint::kEvictFirst;
      bulk::copy<kHint>(stages + (tile % kStages) * kStageBytes + lane * kTokenBytes,
                        a.cache + static_cast<std::int64_t>(slot) * kTokenBytes,
                        static_cast<std::uint32_t>(run * kTokenBytes), bar);
    }
  };
  auto issue_tile = [&](int tile) {
    if constexpr (kBulk) issue_bulk(tile);
    else issue_copies(tile);
  };
  for (int t = 0; t < kStages - 1; ++t) issue_tile(t);

  // ---- queries: latent as f16 scaled by 2^e per row (max |q| in [2^12, 2^13)), rope as bf16 ----
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int row = warp + 4 * i;
    std::uint32_t packed[8];
    note_nonfinite_q<kChecks>(a, fault, b, split, row, 2 * lane, q_latent[i][0]);
    note_nonfinite_q<kChecks>(a, fault, b, split, row, 2 * lane + 1, q_latent[i][1]);
    if (lane < 8) note_nonfinite_q<kChecks>(a, fault, b, split, row, 64 + lane, q_rope[i]);
    const float undo = latent_row_to_f16(q_latent[i][0], q_latent[i][1], packed);
    unsigned char* dst = q_s + row * kQStride + lane * 32;
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    *reinterpret_cast<uint4*>(dst + 16) = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    if (lane < 8) *reinterpret_cast<uint4*>(q_rope_s + row * kRopeStride + lane * 16) = q_rope[i];
    if (lane == 0) row_qscale[row] = undo;
  }
  __syncthreads();  // the queries are staged

  // Causal limit of the rows this thread writes scores for: rows n * 8 + 2c + e see tokens < visible.
  // At 8 rows their query scales too (undone in the score partials), held in registers for the
  // whole loop; at 16 those 4 more registers spill, and the scales are read from shared memory.
  constexpr bool kQScaleInRegisters = kNt == 1;
  int visible[kNt][2];
  float qscale[kNt][2];
#pragma unroll
  for (int n = 0; n < kNt; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = n * 8 + 2 * c + e;
      visible[n][e] = visible_tokens(a, rows, len, row);
      if constexpr (kQScaleInRegisters) qscale[n][e] = row_qscale[row];
    }
  // Running softmax state of rows n * 8 + r (log2 domain), the same in every warp, and the running
  // unit of scale block `warp`: the largest scale seen, so that P' = P x scale / unit <= 1.
  float row_max[kNt], row_sum[kNt];
#pragma unroll
  for (int n = 0; n < kNt; ++n) row_max[n] = -INFINITY, row_sum[n] = 0.0f;
  float unit = 0.0f;
  const int hidden_from = first_hidden_token(visible_tokens(a, rows, len, 0), rows.count, len);

  float acc_o[8][kNt][4];
#pragma unroll
  for (int m = 0; m < 8; ++m)
#pragma unroll
    for (int n = 0; n < kNt; ++n) acc_o[m][n][0] = acc_o[m][n][1] = acc_o[m][n][2] = acc_o[m][n][3] = 0.0f;

  for (int tile = 0; tile < num_tiles; ++tile) {
    if constexpr (kBulk) bulk::wait(&bars[tile % kStages], (tile / kStages) & 1);
    else cp_async_wait<kStages - 2>();
    __syncthreads();  // (A) this tile is staged; the previous tile's output math is done
    issue_tile(tile + kStages - 1);
    std::int32_t ahead_entry = -1;  // token `tid` of tile + kStages: loaded now, made a slot at the end
    const int ahead_t = begin + (tile + kStages) * kTile + tid;
    if (tid < kTile && tile + kStages < num_tiles && ahead_t < end) ahead_entry = entry_at(ahead_t);

    const std::uint8_t* kv = stages + (tile % kStages) * kStageBytes;
    const std::int32_t* tile_slots = slot_s + (tile % kStages) * kTile;  // rewritten only at the end
    const int tile_begin = begin + tile * kTile;

    // ---- score partials S^T for tokens tok0 = 16 (warp % 2) + r and tok0 + 8 ----
    {
      const int half = warp / 2;
      const int tok0 = 16 * (warp % 2) + r, tok1 = tok0 + 8;
      float acc[3][kNt][4];
#pragma unroll
      for (int j = 0; j < 3; ++j)
#pragma unroll
        for (int n = 0; n < kNt; ++n) acc[j][n][0] = acc[j][n][1] = acc[j][n][2] = acc[j][n][3] = 0.0f;
#pragma unroll
      for (int gl = 0; gl < 4; ++gl) {  // 64-dim groups of this half: blocks 2 half + gl / 2
        const int g = half * 4 + gl;
        const uint4 k0 = lds128(kv + tok0 * kTokenBytes + 64 * g + 16 * c);
        const uint4 k1 = lds128(kv + tok1 * kTokenBytes + 64 * g + 16 * c);
        const std::uint32_t k0w[4] = {k0.x, k0.y, k0.z, k0.w}, k1w[4] = {k1.x, k1.y, k1.z, k1.w};
        uint4 qa[kNt], qb[kNt];
#pragma unroll
        for (int n = 0; n < kNt; ++n) {
          const unsigned char* qrow = q_s + (n * 8 + r) * kQStride + (64 * g + 16 * c) * 2;
          qa[n] = lds128(qrow);
          qb[n] = lds128(qrow + 16);
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const std::uint32_t a0 = fp8x2_to_f16x2(k0w[s]), a2 = fp8x2_hi_to_f16x2(k0w[s]);
          const std::uint32_t a1 = fp8x2_to_f16x2(k1w[s]), a3 = fp8x2_hi_to_f16x2(k1w[s]);
#pragma unroll
          for (int n = 0; n < kNt; ++n) {
            const std::uint32_t qw[8] = {qa[n].x, qa[n].y, qa[n].z, qa[n].w, qb[n].x, qb[n].y, qb[n].z, qb[n].w};
            mma_f16_16816(acc[gl / 2][n], a0, a1, a2, a3, qw[2 * s], qw[2 * s + 1]);
          }
        }
      }
      // The rope, bf16 both sides in natural order: at 8 rows each half takes two of its four
      // k-steps, so that the halves reach barrier (B) together (H200, B 64 x 8K: 104.4 -> 102.9 us);
      // at 16 rows half 1 takes all four (split, the 16-row kernel measured 2% slower).
      constexpr bool kSplitRope = kNt == 1;
      if (kSplitRope || half == 1) {
#pragma unroll
        for (int kk = 0; kk < (kSplitRope ? 2 : 4); ++kk) {
          const int ks = kSplitRope ? 2 * half + kk : kk;
          const std::uint8_t* k0r = kv + tok0 * kTokenBytes + 528 + 32 * ks + 4 * c;
          const std::uint8_t* k1r = kv + tok1 * kTokenBytes + 528 + 32 * ks + 4 * c;
          const std::uint32_t a0 = lds32(k0r), a2 = lds32(k0r + 16), a1 = lds32(k1r), a3 = lds32(k1r + 16);
#pragma unroll
          for (int n = 0; n < kNt; ++n) {
            const unsigned char* qr = q_rope_s + (n * 8 + r) * kRopeStride + 32 * ks + 4 * c;
            mma_bf16_16816(acc[2][n], a0, a1, a2, a3, lds32(qr), lds32(qr + 16));
          }
        }
      }
      // Element e of n-tile n: token (e < 2 ? tok0 : tok1), row n * 8 + 2c + (e & 1). A token past
      // the split, past the row's causal limit or without a slot (not read) is -inf in both halves.
      const float2 scales0 = token_scale_pair(kv, tok0, 2 * half), scales1 = token_scale_pair(kv, tok1, 2 * half);
      const float sc0[2] = {nan_if_infinite(scales0.x), nan_if_infinite(scales0.y)};
      const float sc1[2] = {nan_if_infinite(scales1.x), nan_if_infinite(scales1.y)};
      const int pos0 = tile_begin + tok0, pos1 = tile_begin + tok1;
      const bool read0 = pos0 < end && tile_slots[tok0] >= 0, read1 = pos1 < end && tile_slots[tok1] >= 0;
#pragma unroll
      for (int n = 0; n < kNt; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int token = e < 2 ? tok0 : tok1;
          const int row = n * 8 + 2 * c + (e & 1);
          const float* sc = e < 2 ? sc0 : sc1;
          const float q_undo = kQScaleInRegisters ? qscale[n][e & 1] : row_qscale[row];
          float part = (acc[0][n][e] * sc[0] + acc[1][n][e] * sc[1]) * q_undo;
          if (kSplitRope || half == 1) part += acc[2][n][e];
          const bool keep = (e < 2 ? read0 : read1) && (e < 2 ? pos0 : pos1) < visible[n][e & 1];
          s_part[(half * kRows + row) * kSStride + token] = keep ? part : -INFINITY;
        }
      }
    }
    __syncthreads();  // (B) score partials complete
    // Non-finite V codes and scales of the tokens some row does not see, zeroed (decode_common.cuh):
    // warp w, the only reader of block w's codes and scales from here on, zeroes its own.
    if (tile_begin + kTile > hidden_from) {
      std::uint8_t* staged = stages + (tile % kStages) * kStageBytes;
      const int last = min(end - tile_begin, kTile);
#pragma unroll 1
      for (int t = max(hidden_from - tile_begin, 0); t < last; ++t) {
        auto* codes = reinterpret_cast<std::uint32_t*>(staged + t * kTokenBytes + 128 * warp) + lane;
        *codes = finite_fp8x4(*codes);
        if (lane == 0) {
          auto* scale = reinterpret_cast<float*>(staged + t * kTokenBytes + 512) + warp;
          *scale = finite_or_zero(*scale);
        }
      }
      __syncwarp();
    }

    // ---- online softmax over the tile, in every warp: lane (r, c) takes rows n * 8 + r and the tokens
    // 16 ks + 2c + {0, 1, 8, 9} (ks = 0, 1) that its B fragments of P' hold: p[n][4 ks + {0, 1, 2, 3}] ----
    float p[kNt][8], alpha[kNt];
#pragma unroll
    for (int n = 0; n < kNt; ++n) {
      const float* s0 = s_part + (n * 8 + r) * kSStride + 2 * c;
      const float* s1 = s0 + kRows * kSStride;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // tokens 8 j + 2c, + 1
        const float2 h0 = *reinterpret_cast<const float2*>(s0 + 8 * j);
        const float2 h1 = *reinterpret_cast<const float2*>(s1 + 8 * j);
        p[n][2 * j] = (h0.x + h1.x) * a.scale_log2;
        p[n][2 * j + 1] = (h0.y + h1.y) * a.scale_log2;
        mx = fmaxf(mx, fmaxf(p[n][2 * j], p[n][2 * j + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float new_max = fmaxf(row_max[n], mx);
      const float base = new_max == -INFINITY ? 0.0f : new_max;  // every token masked so far: p = 2^-inf = 0
      alpha[n] = fast_exp2(row_max[n] - base);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        p[n][i] = fast_exp2(p[n][i] - base);
        sum += p[n][i];
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      row_sum[n] = row_sum[n] * alpha[n] + sum;
      row_max[n] = new_max;
    }
    // ---- the scale block of this warp: ratio = scale / unit for the same tokens ----
    float ratio[8];
    float gamma;
    {
      float mx = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        ratio[i] = token_scale(kv, 8 * (i / 2) + 2 * c + i % 2, warp);
        mx = fmaxf(mx, ratio[i]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float new_unit = fmaxf(unit, mx);
      const float inv = new_unit > 0.0f ? fast_rcp(new_unit) : 0.0f;
      gamma = new_unit > 0.0f ? unit * inv : 1.0f;
      unit = new_unit;
#pragma unroll
      for (int i = 0; i < 8; ++i) ratio[i] *= inv;
    }

    // ---- O^T += V^T P'^T for the 128 dims of block `warp` ----
    {
#pragma unroll
      for (int n = 0; n < kNt; ++n) {  // the accumulators hold rows n * 8 + 2c, + 1: lanes 8c, 8c + 4
        const float f0 = __shfl_sync(0xffffffffu, alpha[n], 8 * c) * gamma;
        const float f1 = __shfl_sync(0xffffffffu, alpha[n], 8 * c + 4) * gamma;
        if (__any_sync(0xffffffffu, f0 != 1.0f || f1 != 1.0f)) {
#pragma unroll
          for (int m = 0; m < 8; ++m) {
            acc_o[m][n][0] *= f0;
            acc_o[m][n][1] *= f1;
            acc_o[m][n][2] *= f0;
            acc_o[m][n][3] *= f1;
          }
        }
      }
#pragma unroll
      for (int ks = 0; ks < kTile / 16; ++ks) {
        const int t = 16 * ks + 2 * c;
        std::uint32_t b_hi[kNt][2], b_lo[kNt][2];
#pragma unroll
        for (int n = 0; n < kNt; ++n) {
          const float* pk = p[n] + 4 * ks;
          const float* rk = ratio + 4 * ks;
          split_f16x2(pk[0] * rk[0], pk[1] * rk[1], b_hi[n][0], b_lo[n][0]);
          split_f16x2(pk[2] * rk[2], pk[3] * rk[3], b_hi[n][1], b_lo[n][1]);
        }
#pragma unroll
        for (int gi = 0; gi < 2; ++gi) {
          // Dims dim_r .. dim_r + 7 of tokens t, t + 1, t + 8, t + 9, one 8-byte load each: the
          // first four for row r, the last four for row r + 8.
          const int dim_r = 64 * (2 * warp + gi) + 8 * r;
          const std::uint8_t* t0p = kv + t * kTokenBytes + dim_r;
          const uint2 x00 = lds64(t0p), x01 = lds64(t0p + kTokenBytes);
          const uint2 x10 = lds64(t0p + 8 * kTokenBytes), x11 = lds64(t0p + 9 * kTokenBytes);
          // Token pairs per dim: selector 0x5140 -> dims +0, +1; 0x7362 -> dims +2, +3.
          const std::uint32_t pa[2] = {prmt(x00.x, x01.x, 0x5140), prmt(x00.x, x01.x, 0x7362)};
          const std::uint32_t pb[2] = {prmt(x00.y, x01.y, 0x5140), prmt(x00.y, x01.y, 0x7362)};
          const std::uint32_t pc[2] = {prmt(x10.x, x11.x, 0x5140), prmt(x10.x, x11.x, 0x7362)};
          const std::uint32_t pd[2] = {prmt(x10.y, x11.y, 0x5140), prmt(x10.y, x11.y, 0x7362)};
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // m-tile: rows r -> dim dim_r + j, r + 8 -> dim dim_r + 4 + j
            // (A direct call each, not one through a function pointer: nvcc 13 left that pointer's
            // calls in the sm_120a code, 64 per tile.)
            const auto cvt = [j](std::uint32_t codes) {
              return j % 2 == 0 ? fp8x2_to_f16x2(codes) : fp8x2_hi_to_f16x2(codes);
            };
            const std::uint32_t a0 = cvt(pa[j / 2]), a1 = cvt(pb[j / 2]), a2 = cvt(pc[j / 2]), a3 = cvt(pd[j / 2]);
            float(&acc)[kNt][4] = acc_o[4 * gi + j];
#pragma unroll
            for (int n = 0; n < kNt; ++n) {
              mma_f16_16816(acc[n], a0, a1, a2, a3, b_hi[n][0], b_hi[n][1]);
              mma_f16_16816(acc[n], a0, a1, a2, a3, b_lo[n][0], b_lo[n][1]);
            }
          }
        }
      }
    }
    if (tid < kTile && tile + kStages < num_tiles) {  // read by issue_tile(tile + kStages) after sync (A)
      slot_s[(tile % kStages) * kTile + tid] = ahead_t < end ? entry_to_slot(a, ahead_t, ahead_entry, bad_token) : -1;
    }
  }

  // ---- epilogue: o = unit x O / sum, back in natural dim order, staged in shared memory so that
  // the rows go out as whole 16-byte pieces (o, or the split's partial) ----
  allow_next_kernel();
  const Piece done = kBalanced ? Piece{piece_s[0], piece_s[1], piece_s[2], piece_s[3], 1, piece_s[4]} : even_piece();
  note_bad_entry<kChecks>(a, fault, done.b, bad_token);
  __syncthreads();  // every warp is done with the last tile: its stage is free
  float* out_s = reinterpret_cast<float*>(stages);  // f32 [kRows][kOutStride]
#pragma unroll
  for (int n = 0; n < kNt; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = n * 8 + 2 * c + e;  // its state is held by lanes 4 (2c + e) + any
      const float l = __shfl_sync(0xffffffffu, row_sum[n], 4 * (2 * c + e));
      const float mx = __shfl_sync(0xffffffffu, row_max[n], 4 * (2 * c + e));
      const float inv = l > 0.0f ? unit / l : 0.0f;
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const int dim = 64 * (2 * warp + m / 4) + 8 * r + m % 4;
        out_s[row * kOutStride + dim] = acc_o[m][n][e] * inv;
        out_s[row * kOutStride + dim + 4] = acc_o[m][n][e + 2] * inv;
      }
      if (warp == 0 && r == 0 && row < rows.count) {
        const float lse = row_lse(mx, l);
        if (done.count == 1) a.lse[rows.origin + row] = lse;
        else if constexpr (kBalanced) a.lse_part[done.slot_row(done.j, row, a.rows)] = lse;
        else a.lse_part[static_cast<std::int64_t>(split) * a.batch * a.rows + b * a.rows + row] = lse;
      }
    }
  }
  __syncthreads();
  for (int idx = tid; idx < rows.count * (512 / 4); idx += kThreads) {
    const int row = idx / (512 / 4), piece = idx % (512 / 4);
    const float4 v = *reinterpret_cast<const float4*>(out_s + row * kOutStride + 4 * piece);
    if (done.count == 1) {
      reinterpret_cast<uint2*>(a.o + (rows.origin + row) * 512)[piece] =
          make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
    } else {
      // (The same slot either way; the even grid's own arithmetic keeps its instances' code as it
      // was measured: through slot_row the checked 16-row ones spill more.)
      if constexpr (kBalanced) {
        reinterpret_cast<float4*>(a.o_part + done.slot_row(done.j, row, a.rows) * 512)[piece] = v;
      } else {
        const std::int64_t part_row = static_cast<std::int64_t>(split) * a.batch * a.rows + b * a.rows + row;
        reinterpret_cast<float4*>(a.o_part + part_row * 512)[piece] = v;
      }
    }
  }
  if (!kGrouped && a.merge_splits) {
    cooperative_groups::this_grid().sync();  // every split's partials and lse are written
    // The stages are free: the rows went out before the barrier. (A balanced grid's request of one
    // piece wrote o and lse.)
    if (!kBalanced || done.count > 1) merge_splits(a, done, stages);
  }
}

// Tiles come in by the copy engine (kBulk) on sm_90 and later for a dense decode whose pages hold
// at least a tile, so that a tile is one or two runs of consecutive slots; otherwise (a sparse
// decode's scattered slots, small pages, sm_89) by cp.async. H200, the same build in one call, bulk /
// cp.async: H 8 B 64 x 8K 97.3 / 103.2 us, H 16 B 64 136.6 / 140.8, B 1 x 256K 58.1 / 58.9, B 1 x 32K
// 18.5 / 18.6; but sparse H 8 B 64 41.4 / 40.8 and sparse B 1 11.1 / 9.8, one copy per token
// (docs/benchmarks.md, twenty-second session).
// The bulk instances run real copies only from code compiled for sm_90 or later: not from sm_89
// code, nor from sm_89 PTX compiled for a newer GPU at load time (its copies would trap).
bool bulk_copies(const DecodeArgs& a) {
  if (a.indices != nullptr || a.page_size < kTile) return false;
  return once_per_key(current_device("mla_decode"), [] {
    cudaFuncAttributes attributes{};
    check(cudaFuncGetAttributes(&attributes, narrow_kernel<1, 2, false, false, true, false>), "mla_decode",
          "cudaFuncGetAttributes");
    return attributes.ptxVersion >= 90;
  });
}

// Raises the kernel's dynamic shared-memory limit (once per device); returns the bytes it launches with.
template <int kNt, int kStages, bool kChecks = false, bool kGrouped = false, bool kBulk = false, bool kBalanced = false>
int configure() {
  constexpr int kSmem = NarrowSmem<kNt, kStages>::kBytes;
  return allow_dynamic_smem(narrow_kernel<kNt, kStages, kChecks, kGrouped, kBulk, kBalanced>, kSmem, "mla_decode");
}

// The plan asks it of the cp.async instance; a launch of the bulk one asks it of that (the two take
// the same shared memory and launch bounds).
template <int kNt, int kStages, bool kChecks = false, bool kBulk = false>
int blocks_per_sm() {
  return resident_ctas_per_sm(narrow_kernel<kNt, kStages, kChecks, false, kBulk, false>, kThreads,
                              configure<kNt, kStages, kChecks, false, kBulk>(), "mla_decode");
}

// The grid (splits, B); merged in the kernel when there are 2 to kMergeMostSplits splits, the device
// takes cooperative launches, the whole grid is resident at once and the merge's staging fits in the
// tile stages. A grouped prefill's splits always go to the combine. A dense decode merged in the
// kernel on bulk copies, of at most kBalancedMostBatch requests, runs the balanced grid (its own
// instance; the same shared memory and launch bounds, so the same CTAs per SM).
template <int kNt, int kStages, bool kChecks, bool kGrouped, bool kBulk>
bool launch_instance(const char* op, DecodeArgs a, const FaultSink& fault, const int2* spans, cudaStream_t stream) {
  const int smem_bytes = configure<kNt, kStages, kChecks, kGrouped, kBulk>();
  const DeviceLimits& device = current_device_limits("mla_decode");
  const std::int64_t ctas = static_cast<std::int64_t>(a.num_splits) * a.batch;
  a.merge_splits = !kGrouped && a.num_splits > 1 && device.cooperative &&
                   ctas <= static_cast<std::int64_t>(blocks_per_sm<kNt, kStages, kChecks, kBulk>()) * device.multiprocessors &&
                   a.num_splits <= kMergeMostSplits &&
                   merge_bytes(a.num_splits, a.rows) <= static_cast<std::size_t>(kStages) * kStageBytes;
  const dim3 grid(static_cast<unsigned>(a.num_splits), static_cast<unsigned>(a.batch));
  if constexpr (kBulk && !kGrouped) {
    const bool balanced = a.merge_splits && a.indices == nullptr && a.batch > 1 && a.batch <= kBalancedMostBatch &&
                          most_merge_bytes(a.rows) <= static_cast<std::size_t>(kStages) * kStageBytes;
    if (balanced) {
      launch_chained(op, narrow_kernel<kNt, kStages, kChecks, false, true, true>, grid, kThreads,
                     configure<kNt, kStages, kChecks, false, true, true>(), stream, true, a, fault, spans);
      return true;
    }
  }
  launch_chained(op, narrow_kernel<kNt, kStages, kChecks, kGrouped, kBulk, false>, grid, kThreads, smem_bytes, stream,
                 a.merge_splits, a, fault, spans);
  return a.merge_splits;
}
template <int kNt, int kStages, bool kBulk>
bool launch_instance(const char* op, const DecodeArgs& a, const FaultSink& fault, const int2* spans, cudaStream_t stream) {
  if (spans != nullptr) {
    if (fault.record != nullptr) throw Error(op, "fault", "a record", "none for the grouped decode");
    return launch_instance<kNt, kStages, false, true, kBulk>(op, a, fault, spans, stream);
  }
  return fault.record != nullptr ? launch_instance<kNt, kStages, true, false, kBulk>(op, a, fault, spans, stream)
                                 : launch_instance<kNt, kStages, false, false, kBulk>(op, a, fault, spans, stream);
}
template <int kNt, int kStages>
bool launch_instance(const char* op, const DecodeArgs& a, const FaultSink& fault, const int2* spans, cudaStream_t stream) {
  return bulk_copies(a) ? launch_instance<kNt, kStages, true>(op, a, fault, spans, stream)
                        : launch_instance<kNt, kStages, false>(op, a, fault, spans, stream);
}

}  // namespace

bool launch_decode_narrow(const char* op, const DecodeArgs& a, const FaultSink& fault, const int2* spans,
                          cudaStream_t stream) {
  const bool shallow = a.batch >= kShallowFromBatch;
  if (a.rows <= 8) {
    return shallow ? launch_instance<1, 2>(op, a, fault, spans, stream)
                   : launch_instance<1, 3>(op, a, fault, spans, stream);
  }
  return shallow ? launch_instance<2, 2>(op, a, fault, spans, stream) : launch_instance<2, 3>(op, a, fault, spans, stream);
}
int narrow_blocks_per_sm(int rows, int batch) {
  const bool shallow = batch >= kShallowFromBatch;
  if (rows <= 8) return shallow ? blocks_per_sm<1, 2>() : blocks_per_sm<1, 3>();
  return shallow ? blocks_per_sm<2, 2>() : blocks_per_sm<2, 3>();
}

}  // namespace latentkv::cuda::mla
