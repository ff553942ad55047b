// v1 W8A16 GEMM on the packed FP8 layout (vLLM's Marlin layout, marlin_fp8.h),
// kept selectable (marlin_fp8_gemm(..., version=1)) beside v2
// (marlin_fp8_gemm_v2.cu) until a GPU has measured both:
//   C[M, N] = A[M, K] · (decode(W) · scale)^T,  A bf16/fp16 with row stride lda >= K.
//
// Small-M design (M <= 16 is weight-bandwidth bound): one CTA per 64-column
// weight panel and 16-row block of A, so every SM streams a disjoint part of
// the weight once. The CTA's 4 warps split K (warp w takes k-tiles w, w+4, ...)
// and each runs its own cp.async pipeline (kStages deep) of 1 KiB weight tiles
// (tile (kt, nt) of the panel: qweight row kt, words nt*256 ...) plus the
// matching 16x16 A tile, so no block-wide barrier sits in the main loop. A
// warp dequantizes each weight word in registers (masks + shifts) into
// m16n8k16 B fragments and issues 8 mma.sync per k-tile with fp32
// accumulation. Scales (activation dtype, bias folded) are widened to fp32 and
// applied to each group's fp32 partial sum when the group ends (per-channel:
// one group = all of K). The 4 warps' partials are summed through shared
// memory and stored with the row (M) and column (N) masks. Larger M loops over
// 16-row blocks (grid.y); large M is compute-bound and meant for the
// dequantize-once + 16-bit GEMM path. Needs sm_80+ (cp.async, bf16 mma); no
// fp8 mma is used, so it runs on sm_86.
#include "kv_b_proj/marlin_fp8_device.cuh"

namespace mla_ext {
namespace marlin_fp8 {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 4;
constexpr int kRows = 16;  // rows of A per CTA (one m16 tile)
constexpr int kMaxGridY = 65535;

using dev::act_to_float;
using dev::cp_async16;
using dev::cp_async_commit;
using dev::cp_async_wait;
using dev::from_float;
using dev::mma_16816;

// The lane's 16 scales (two runs of 8, see lane_scale_run) -> sc[j][e] in fp32.
template <ActKind kAct, bool kGrouped>
__device__ __forceinline__ void unpack_scales(const uint4& r0, const uint4& r1, float (&sc)[8][2]) {
  const uint32_t w[2][4] = {{r0.x, r0.y, r0.z, r0.w}, {r1.x, r1.y, r1.z, r1.w}};
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int el = lane_scale_elem(kGrouped, j, e);
      sc[j][e] = act_to_float<kAct>((w[lane_scale_which(kGrouped, j, e)][el / 2] >> (16 * (el % 2))) & 0xFFFFu);
    }
}

template <ActKind kAct, typename OutT>
// register budget: 128
__global__ void __launch_bounds__(kThreads) marlin_fp8_gemm_kernel(GemmParams p) {
  // Per-warp pipelines: weight tiles (1 KiB) and A tiles (16x16, 512 B).
  __shared__ __align__(16) uint32_t s_w[kWarps][kStages][kWordsPerTile];
  __shared__ __align__(16) uint16_t s_a[kWarps][kStages][kRows * kTileK];
  __shared__ float s_red[kWarps][kRows][kTileN + 1];  // +1: fewer bank conflicts

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t nt = blockIdx.x;
  const int64_t k_tiles = p.K / kTileK;
  const int64_t n_pad = padded_n(p.N), n_tiles = n_pad / kTileN;
  const int64_t gt = group_tiles(p.K, p.group_size);
  const bool grouped = grouped_scales(p.K, p.group_size);
  const int64_t my_tiles = k_tiles > warp ? (k_tiles - warp + kWarps - 1) / kWarps : 0;
  // Tile kt of this panel starts at w_lane + kt * k_stride (k-tiles outermost).
  const uint32_t* w_lane = p.qweight + tile_word(0, nt, n_tiles) + lane * kWordsPerLane;
  const int64_t k_stride = n_tiles * kWordsPerTile;
  const uint16_t* s_run0 = p.scales + nt * kTileN + lane_scale_run(grouped, t, 0);
  const uint16_t* s_run1 = p.scales + nt * kTileN + lane_scale_run(grouped, t, 1);
  // A copy: lane copies 8 elements (16 B) of row lane/2 of the 16x16 tile.
  const int a_row = lane / 2, a_col = (lane % 2) * 8;
  const int64_t m_blocks = (p.M + kRows - 1) / kRows;

  for (int64_t mb = blockIdx.y; mb < m_blocks; mb += gridDim.y) {
    const int64_t m = mb * kRows + a_row;
    const bool a_valid = m < p.M;
    // Masked rows read nothing (src-size 0) but keep a valid address (row 0).
    const uint16_t* a_src = p.a + (a_valid ? m : 0) * p.lda + a_col;

    auto issue = [&](int64_t i) {
      const int st = static_cast<int>(i % kStages);
      const int64_t kt = warp + i * kWarps;
      const uint32_t* src = w_lane + kt * k_stride;
      cp_async16(&s_w[warp][st][lane * kWordsPerLane], src, true);
      cp_async16(&s_w[warp][st][lane * kWordsPerLane + 4], src + 4, true);
      cp_async16(&s_a[warp][st][a_row * kTileK + a_col], a_src + kt * kTileK, a_valid);
    };

    // Always commit a group (possibly empty) so wait_group counts line up.
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < my_tiles) issue(s);
      cp_async_commit();
    }

    float acc[8][4], part[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = part[j][e] = 0.0f;

    for (int64_t i = 0; i < my_tiles; ++i) {
      if (i + kStages - 1 < my_tiles) issue(i + kStages - 1);
      cp_async_commit();
      cp_async_wait<kStages - 1>();  // tile i has landed (this lane's copies)
      __syncwarp();                  // ... and every other lane's (A is shared)

      const int st = static_cast<int>(i % kStages);
      const uint16_t* sa = s_a[warp][st];
      uint32_t af[4];
      // m16n8k16 A fragment: rows g / g+8, k pairs 2t / 2t+8.
      af[0] = *reinterpret_cast<const uint32_t*>(sa + g * kTileK + 2 * t);
      af[1] = *reinterpret_cast<const uint32_t*>(sa + (g + 8) * kTileK + 2 * t);
      af[2] = *reinterpret_cast<const uint32_t*>(sa + g * kTileK + 2 * t + 8);
      af[3] = *reinterpret_cast<const uint32_t*>(sa + (g + 8) * kTileK + 2 * t + 8);
      const uint4 w0 = *reinterpret_cast<const uint4*>(&s_w[warp][st][lane * kWordsPerLane]);
      const uint4 w1 = *reinterpret_cast<const uint4*>(&s_w[warp][st][lane * kWordsPerLane + 4]);
      const uint32_t words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t b[2];
        dequant_word<kAct>(words[j], b);
        mma_16816<kAct>(part[j], af, b);
      }

      const int64_t kt = warp + i * kWarps;
      if (i + 1 == my_tiles || (kt + kWarps) / gt != kt / gt) {
        // Group ends for this warp: acc += part * scale[group] (16 scales per lane).
        const int64_t row = (kt / gt) * n_pad;
        const uint4 r0 = __ldg(reinterpret_cast<const uint4*>(s_run0 + row));
        const uint4 r1 = __ldg(reinterpret_cast<const uint4*>(s_run1 + row));
        float sc[8][2];
        if (grouped) {
          unpack_scales<kAct, true>(r0, r1, sc);
        } else {
          unpack_scales<kAct, false>(r0, r1, sc);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[j][0] += part[j][0] * sc[j][0];
          acc[j][1] += part[j][1] * sc[j][1];
          acc[j][2] += part[j][2] * sc[j][0];
          acc[j][3] += part[j][3] * sc[j][1];
#pragma unroll
          for (int e = 0; e < 4; ++e) part[j][e] = 0.0f;
        }
      }
      __syncwarp();  // stage st is refilled by the next iteration's issue
    }
    cp_async_wait<0>();

    // C fragment: (row g, cols 8j+2t, +1) and (row g+8, same cols).
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = j * 8 + 2 * t;
      s_red[warp][g][col] = acc[j][0];
      s_red[warp][g][col + 1] = acc[j][1];
      s_red[warp][g + 8][col] = acc[j][2];
      s_red[warp][g + 8][col + 1] = acc[j][3];
    }
    __syncthreads();
    OutT* c = static_cast<OutT*>(p.c);
    for (int idx = threadIdx.x; idx < kRows * kTileN; idx += kThreads) {
      const int r = idx / kTileN, col = idx % kTileN;
      const int64_t mm = mb * kRows + r, n = nt * kTileN + col;
      if (mm < p.M && n < p.N) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += s_red[w][r][col];
        c[mm * p.ldc + n] = from_float<OutT>(v);
      }
    }
    __syncthreads();  // s_red and the pipelines are reused by the next row block
  }
}

template <ActKind kAct>
void launch_for_out(const GemmParams& p, dim3 grid, cudaStream_t st) {
  switch (p.out) {
    case OutKind::kFp32: marlin_fp8_gemm_kernel<kAct, float><<<grid, kThreads, 0, st>>>(p); break;
    case OutKind::kFp16: marlin_fp8_gemm_kernel<kAct, __half><<<grid, kThreads, 0, st>>>(p); break;
    case OutKind::kBf16: marlin_fp8_gemm_kernel<kAct, __nv_bfloat16><<<grid, kThreads, 0, st>>>(p); break;
  }
}

}  // namespace

int marlin_fp8_gemm_cuda(const GemmParams& p, void* stream) {
  if (p.M == 0 || p.N == 0) return 0;
  const int64_t m_blocks = (p.M + kRows - 1) / kRows;
  const dim3 grid(static_cast<unsigned>(padded_n(p.N) / kTileN),
                  static_cast<unsigned>(m_blocks < kMaxGridY ? m_blocks : kMaxGridY));
  auto st = static_cast<cudaStream_t>(stream);
  if (p.act == ActKind::kFp16) {
    launch_for_out<ActKind::kFp16>(p, grid, st);
  } else {
    launch_for_out<ActKind::kBf16>(p, grid, st);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace marlin_fp8
}  // namespace mla_ext
