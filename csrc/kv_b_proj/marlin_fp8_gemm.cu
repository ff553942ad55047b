// The W8A16 GEMM on the packed FP8 layout (vLLM's Marlin layout, marlin_fp8.h):
//   C[M, N] = A[M, K] · (decode(W) · scale)^T,  A bf16/fp16 with row stride lda >= K.
//
// Design, for small M (weight-bandwidth bound):
// - Split-K. A CTA computes one output tile (16*mb rows x 64*np columns) over
//   one K slice; plan_gemm (marlin_fp8.h) picks the slices from the tiles and
//   the SM count, bounded so that the partials written and re-read never
//   exceed the weight's bytes: at N = 4096, K = 512 and M <= 16 (16 tiles)
//   4 slices put 64 CTAs on the SMs (8 would move 4 MB of partials for 2 MB
//   of weights). Every slice writes its fp32 partial to a global workspace
//   (thread-major, coalesced, L2 resident); the tile's last slice to arrive
//   (an atomic ticket) sums the partials in slice order 0..split-1, so the
//   result does not depend on which CTA finishes last, and resets the tile's
//   counter. No host sync, workspace sized from the shapes: CUDA-graph safe.
// - Up to four 16-row blocks per CTA (mb), warps split the columns: a warp
//   owns ws n8 sub-tiles of one 64-column panel for all mb row blocks, so a
//   weight word is streamed once per CTA, dequantized once and feeds mb
//   mma.sync; A is read once per 64*np columns, and there is
//   no cross-warp reduction (no reduction buffer at all).
// - One CTA-wide cp.async pipeline (4 stages of 2 k-tiles: weight tiles, the
//   A tile and, with the k-tile that ends a scale group, that group's scale
//   row), so the scales arrive through the pipeline too (no blocking load at
//   a group end). One __syncthreads per stage.
// - Shared memory is XOR-swizzled (16-byte chunk index ^ bit 2 of the row /
//   lane) so the B-word reads and the ldmatrix A reads are conflict-free
//   (ws = 2: 2-way on the 8-byte B reads).
// Scales are applied to each group's fp32 partial sum when the group (or the
// slice) ends, as in the CPU reference, which reproduces the slicing.
// Needs sm_80+ (cp.async, ldmatrix, bf16 mma.sync); no fp8 mma, so it runs on sm_86.
#include "kv_b_proj/marlin_fp8_device.cuh"

namespace mla_ext {
namespace marlin_fp8 {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kStages = 4;
constexpr int kKT = kStageTiles;  // k-tiles per stage
constexpr int kMinBlocks = 4;  // 4 CTAs (16 warps) per SM: at most 128 registers per thread

using dev::act_to_float;
using dev::cp_async16;
using dev::cp_async_commit;
using dev::cp_async_wait;
using dev::ldmatrix_x4;
using dev::mma_16816;

// 16-byte chunk swizzle: chunk h (0/1) of row / lane r sits at slot h ^ bit 2 of r.
__device__ __forceinline__ int swz(int h, int r) { return h ^ ((r >> 2) & 1); }

template <int kMB, int kWS>
struct Stage {
  static constexpr int kNP = kWS / 2, kRowsT = 16 * kMB, kCols = 64 * kNP;
  uint32_t w[kKT][kNP][kWordsPerTile];  // weight tiles, per lane 2 swizzled 16-byte chunks
  uint16_t a[kKT][kRowsT][kTileK];      // A tile, per row 2 swizzled 16-byte chunks
  uint16_t s[kCols];                    // the scale row of the group ending in this stage
};

// scale_pos(8*(jb + j) + 2t + e) = scale_base(jb, t) + scale_off(j, e) for the
// sub-tiles a warp owns (jb % 4 + j < 4 unless jb = 0, for every tiling):
// grouped 8*(2t + e) + jb + j; per-channel 32*((jb+j)/4) + 8t + 2*((jb+j)%4) + e.
template <bool kGrouped>
__device__ __forceinline__ int scale_base(int jb, int t) {
  return kGrouped ? 16 * t + jb : 8 * t + 32 * (jb / 4) + 2 * (jb % 4);
}
template <bool kGrouped>
__host__ __device__ constexpr int scale_off(int j, int e) {
  return kGrouped ? 8 * e + j : 32 * (j / 4) + 2 * (j % 4) + e;
}

template <int A, int B>
__device__ __forceinline__ void zero(float (&x)[A][B][4]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[i][j][e] = 0.0f;
}

template <typename OutT>
__device__ __forceinline__ void store_pair(OutT* c, int64_t ldc, int64_t row, int64_t col, int64_t M, int64_t N,
                                           float v0, float v1) {
  if (row >= M) return;
  OutT* dst = c + row * ldc + col;
  if (col < N) dst[0] = dev::from_float<OutT>(v0);
  if (col + 1 < N) dst[1] = dev::from_float<OutT>(v1);
}

template <ActKind kAct, bool kGrouped, int kMB, int kWS>
// register budget: 128
__global__ void __launch_bounds__(kThreads, kMinBlocks) marlin_fp8_gemm_kernel(GemmParams p, int64_t n_ctiles,
                                                                      int64_t m_tiles, int64_t split) {
  using St = Stage<kMB, kWS>;
  constexpr int kNP = St::kNP, kRowsT = St::kRowsT, kCols = St::kCols;
  constexpr int kWPP = 8 / kWS;   // warps per 64-column panel
  constexpr int kAcc = kMB * kWS * 4;  // accumulators per lane
  __shared__ __align__(16) St smem[kStages];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int pw = warp / kWPP;          // the warp's panel inside the CTA tile
  const int jb = (warp % kWPP) * kWS;  // its first n8 sub-tile inside the panel
  const int n_ct = blockIdx.x, slice = blockIdx.z;
  // k indices fit in 32 bits (K < 2^31); 64-bit only for element offsets.
  const int n_tiles = static_cast<int>(padded_n(p.N) / kTileN), k_tiles = static_cast<int>(p.K / kTileK);
  const int64_t n_pad = static_cast<int64_t>(n_tiles) * kTileN;
  const int gt = static_cast<int>(group_tiles(p.K, p.group_size));
  const int kt0 = slice * static_cast<int>(p.slice_tiles);
  const int kt1 = kt0 + static_cast<int>(p.slice_tiles) < k_tiles ? kt0 + static_cast<int>(p.slice_tiles) : k_tiles;
  const int n_stages = kt1 > kt0 ? (kt1 - kt0 + kKT - 1) / kKT : 0;
  auto group_end = [&](int kt) { return kt + 1 == kt1 || (kt + 1) % gt == 0; };

  // Per-thread copy sources at k-tile 0 (a k-tile further: + k_stride words of
  // qweight, + 16 elements of A). Thread tid copies weight chunks tid + 128q
  // (64 16-byte chunks per panel tile), A chunk tid (2 per row) and scale chunk tid.
  constexpr int kBQ = (kNP * 64 + kThreads - 1) / kThreads;
  const int64_t k_stride = static_cast<int64_t>(n_tiles) * kWordsPerTile;
  const uint32_t* b_src[kBQ];
  bool b_ok[kBQ];
  int b_dst[kBQ];  // word offset inside w[kk]
#pragma unroll
  for (int q = 0; q < kBQ; ++q) {
    const int c = tid + q * kThreads, pp = c / 64, l = (c % 64) / 2, h = c % 2;
    const int panel = n_ct * kNP + pp;
    b_ok[q] = c < kNP * 64 && panel < n_tiles;
    b_src[q] = p.qweight + (b_ok[q] ? tile_word(0, panel, n_tiles) + l * kWordsPerLane + 4 * h : 0);
    b_dst[q] = pp * kWordsPerTile + l * kWordsPerLane + 4 * swz(h, l);
  }
  const int s_base = pw * kTileN + scale_base<kGrouped>(jb, t);
  const int a_r = tid / 2, a_h = tid % 2;  // A chunk (row, half); tid < kRowsT * 2
  const int s_c = tid;                     // scale chunk; tid < kCols / 8
  const bool s_ok = s_c < kCols / 8 && n_ct * kNP + s_c / 8 < n_tiles;
  const uint16_t* s_src = p.scales + (s_ok ? static_cast<int64_t>(n_ct) * kCols + 8 * s_c : 0);

  {
    const int64_t mt = blockIdx.y;  // the host splits M beyond 65535 row tiles into launches
    const int64_t a_m = mt * kRowsT + a_r;
    const bool a_ok = a_r < kRowsT && a_m < p.M;
    const uint16_t* a_src = p.a + (a_ok ? a_m * p.lda + 8 * a_h : 0);

    // Copies of stage i (k-tiles kt0 + i*kKT ...) into slot st.
    auto issue = [&](int i, int st) {
      St& s = smem[st];
#pragma unroll
      for (int kk = 0; kk < kKT; ++kk) {
        const int kt = kt0 + i * kKT + kk;
        if (kt >= kt1) break;
#pragma unroll
        for (int q = 0; q < kBQ; ++q) {
          if (q * kThreads + kThreads <= kNP * 64 || tid + q * kThreads < kNP * 64) {
            cp_async16(&s.w[kk][0][0] + b_dst[q], b_src[q] + (b_ok[q] ? kt * k_stride : 0), b_ok[q]);
          }
        }
        if (kRowsT * 2 >= kThreads || tid < kRowsT * 2) {
          cp_async16(&s.a[kk][a_r][8 * swz(a_h, a_r)], a_src + (a_ok ? kt * kTileK : 0), a_ok);
        }
        if (group_end(kt) && (kCols / 8 >= kThreads || s_c < kCols / 8)) {
          cp_async16(&s.s[8 * s_c], s_src + (s_ok ? (kt / gt) * n_pad : 0), s_ok);
        }
      }
    };

    for (int i = 0; i < kStages - 1; ++i) {
      if (i < n_stages) issue(i, i);
      cp_async_commit();  // possibly empty: keeps wait_group counts aligned
    }

    float acc[kMB][kWS][4];
    float part[kGrouped ? kMB : 1][kGrouped ? kWS : 1][4];  // grouped: the current group's partial
    zero(acc);
    if constexpr (kGrouped) zero(part);

    for (int i = 0; i < n_stages; ++i) {
      cp_async_wait<kStages - 2>();  // this thread's copies of stage i have landed
      __syncthreads();               // everyone's; and stage i-1's slot is free
      if (i + kStages - 1 < n_stages) issue(i + kStages - 1, (i + kStages - 1) % kStages);
      cp_async_commit();
      const St& s = smem[i % kStages];
#pragma unroll
      for (int kk = 0; kk < kKT; ++kk) {
        const int kt = kt0 + i * kKT + kk;
        if (kt >= kt1) break;
        // The lane's words jb .. jb+kWS-1 of its panel tile (swizzled chunks).
        uint32_t words[kWS];
        const uint32_t* wl = s.w[kk][pw] + lane * kWordsPerLane;
        if constexpr (kWS == 8) {
          const uint4 c0 = *reinterpret_cast<const uint4*>(wl + 4 * swz(0, lane));
          const uint4 c1 = *reinterpret_cast<const uint4*>(wl + 4 * swz(1, lane));
          words[0] = c0.x, words[1] = c0.y, words[2] = c0.z, words[3] = c0.w;
          words[4] = c1.x, words[5] = c1.y, words[6] = c1.z, words[7] = c1.w;
        } else if constexpr (kWS == 4) {
          const uint4 c0 = *reinterpret_cast<const uint4*>(wl + 4 * swz(jb / 4, lane));
          words[0] = c0.x, words[1] = c0.y, words[2] = c0.z, words[3] = c0.w;
        } else {
          const uint2 c0 = *reinterpret_cast<const uint2*>(wl + 4 * swz(jb / 4, lane) + jb % 4);
          words[0] = c0.x, words[1] = c0.y;
        }
        // A fragments of every row block: ldmatrix.x4, lane -> row (lane%8) + 8*((lane/8)%2),
        // k chunk (lane/16) of the 16x16 block (matrices a0..a3 of m16n8k16).
        uint32_t af[kMB][4];
#pragma unroll
        for (int mb = 0; mb < kMB; ++mb) {
          const int r = mb * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
          ldmatrix_x4(af[mb], &s.a[kk][r][8 * swz(lane / 16, r)]);
        }
#pragma unroll
        for (int j = 0; j < kWS; ++j) {
          uint32_t b[2];
          dequant_word<kAct>(words[j], b);
#pragma unroll
          for (int mb = 0; mb < kMB; ++mb) {
            if constexpr (kGrouped) {
              mma_16816<kAct>(part[mb][j], af[mb], b);
            } else {
              mma_16816<kAct>(acc[mb][j], af[mb], b);
            }
          }
        }
        if (group_end(kt)) {
          // Scales of the lane's columns (j, e): 8*(jb+j) + 2t + e of the panel,
          // at s_base + scale_off (scale_pos written as a lane base plus a
          // compile-time offset, so no address per column stays live).
          float sc[kWS][2];
#pragma unroll
          for (int j = 0; j < kWS; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) sc[j][e] = act_to_float<kAct>(s.s[s_base + scale_off<kGrouped>(j, e)]);
#pragma unroll
          for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
            for (int j = 0; j < kWS; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                if constexpr (kGrouped) {
                  acc[mb][j][e] += part[mb][j][e] * sc[j][e & 1];
                  part[mb][j][e] = 0.0f;
                } else {  // one group: the slice's sum times the channel scale
                  acc[mb][j][e] *= sc[j][e & 1];
                }
              }
        }
      }
    }
    cp_async_wait<0>();  // only empty groups can be outstanding here

    if (split > 1) {
      // Thread-major partials: element e of thread tid of (slice, tile) at
      // ((slice * tiles + tile) * kAcc + e) * 128 + tid.
      const int64_t tiles = n_ctiles * m_tiles, tile = mt * n_ctiles + n_ct;
      float* mine = p.workspace + (slice * tiles + tile) * kAcc * kThreads + tid;
#pragma unroll
      for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
        for (int j = 0; j < kWS; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) __stcg(mine + ((mb * kWS + j) * 4 + e) * kThreads, acc[mb][j][e]);
      __threadfence();
      __shared__ int s_last;
      __syncthreads();
      if (tid == 0) {
        const int ticket = atomicAdd(p.counters + tile, 1);
        s_last = ticket == split - 1;
        if (s_last) p.counters[tile] = 0;  // ready for the next call / graph replay
      }
      __syncthreads();
      if (!s_last) return;  // uniform
      __threadfence();
      // Every slice's partial (this one's included, re-read from L2) summed in
      // slice order 0..split-1: the same sum whichever CTA arrives last.
      const float* src = p.workspace + tile * kAcc * kThreads + tid;
      zero(acc);
      // Unrolled by two: the next slice's loads are issued before this one's adds
      // (the adds stay in slice order, so the sum is unchanged).
#pragma unroll 2
      for (int64_t sl = 0; sl < split; ++sl, src += tiles * kAcc * kThreads) {
#pragma unroll
        for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
          for (int j = 0; j < kWS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mb][j][e] += __ldcg(src + ((mb * kWS + j) * 4 + e) * kThreads);
      }
    }

    // C fragment of (mb, j): rows 16mb + g / + 8, columns 8(jb+j) + 2t, +1 of the panel.
    const int64_t col0 = (n_ct * kNP + pw) * kTileN + 8 * jb + 2 * t;
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb) {
      const int64_t row = mt * kRowsT + mb * 16 + g;
#pragma unroll
      for (int j = 0; j < kWS; ++j) {
        const int64_t col = col0 + 8 * j;
        switch (p.out) {
          case OutKind::kFp32:
            store_pair(static_cast<float*>(p.c), p.ldc, row, col, p.M, p.N, acc[mb][j][0], acc[mb][j][1]);
            store_pair(static_cast<float*>(p.c), p.ldc, row + 8, col, p.M, p.N, acc[mb][j][2], acc[mb][j][3]);
            break;
          case OutKind::kFp16:
            store_pair(static_cast<__half*>(p.c), p.ldc, row, col, p.M, p.N, acc[mb][j][0], acc[mb][j][1]);
            store_pair(static_cast<__half*>(p.c), p.ldc, row + 8, col, p.M, p.N, acc[mb][j][2], acc[mb][j][3]);
            break;
          case OutKind::kBf16:
            store_pair(static_cast<__nv_bfloat16*>(p.c), p.ldc, row, col, p.M, p.N, acc[mb][j][0], acc[mb][j][1]);
            store_pair(static_cast<__nv_bfloat16*>(p.c), p.ldc, row + 8, col, p.M, p.N, acc[mb][j][2],
                       acc[mb][j][3]);
            break;
        }
      }
    }
  }
}

template <ActKind kAct, bool kGrouped, int kMB, int kWS>
void launch(const GemmParams& p, const GemmPlan& pl, cudaStream_t st) {
  // Row tiles beyond grid.y's limit go to further launches (same stream, so the
  // split-K workspace and counters are reused in order).
  const int64_t rows = kMaxGridY * 16 * kMB;
  const int64_t out_elt = p.out == OutKind::kFp32 ? 4 : 2;
  for (int64_t m0 = 0; m0 < p.M; m0 += rows) {
    GemmParams q = p;
    q.M = p.M - m0 < rows ? p.M - m0 : rows;
    q.a = p.a + m0 * p.lda;
    q.c = static_cast<char*>(p.c) + m0 * p.ldc * out_elt;
    const int64_t m_tiles = (q.M + 16 * kMB - 1) / (16 * kMB);
    const dim3 grid(static_cast<unsigned>(pl.n_ctiles), static_cast<unsigned>(m_tiles),
                    static_cast<unsigned>(pl.split));
    marlin_fp8_gemm_kernel<kAct, kGrouped, kMB, kWS><<<grid, kThreads, 0, st>>>(q, pl.n_ctiles, m_tiles,
                                                                                  pl.split);
  }
}

template <ActKind kAct>
int launch_for_tiling(const GemmParams& p, const GemmPlan& pl, cudaStream_t st) {
  const bool grouped = grouped_scales(p.K, p.group_size);
  const int mb = pl.tiling.mb, ws = pl.tiling.ws;
  if (grouped) {
    if (mb == 1 && ws == 8) return launch<kAct, true, 1, 8>(p, pl, st), 0;
    if (mb == 2 && ws == 4) return launch<kAct, true, 2, 4>(p, pl, st), 0;
    if (mb == 4 && ws == 2) return launch<kAct, true, 4, 2>(p, pl, st), 0;
  } else {
    if (mb == 1 && ws == 8) return launch<kAct, false, 1, 8>(p, pl, st), 0;
    if (mb == 2 && ws == 8) return launch<kAct, false, 2, 8>(p, pl, st), 0;
    if (mb == 4 && ws == 4) return launch<kAct, false, 4, 4>(p, pl, st), 0;
  }
  return static_cast<int>(cudaErrorInvalidConfiguration);  // a tiling gemm_tiling never makes
}

}  // namespace

int marlin_fp8_gemm_cuda(const GemmParams& p, const GemmPlan& plan, void* stream) {
  if (p.M == 0 || p.N == 0) return 0;
  if (plan.split > 1 && (p.workspace == nullptr || p.counters == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  auto st = static_cast<cudaStream_t>(stream);
  const int err = p.act == ActKind::kFp16 ? launch_for_tiling<ActKind::kFp16>(p, plan, st)
                                          : launch_for_tiling<ActKind::kBf16>(p, plan, st);
  return err != 0 ? err : static_cast<int>(cudaGetLastError());
}

int marlin_fp8_device_sm_count(int device) {
  constexpr int kMaxDevices = 64;
  static int cache[kMaxDevices] = {};  // 0: not read yet (an SM count is never 0)
  if (device < 0 || device >= kMaxDevices) return 0;
  if (cache[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();  // clear it: the caller falls back to no split
      return 0;
    }
    cache[device] = n;
  }
  return cache[device];
}

}  // namespace marlin_fp8
}  // namespace mla_ext
