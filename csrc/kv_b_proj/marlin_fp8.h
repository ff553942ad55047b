// Marlin FP8 (W8A16) weights for kv_b_proj in vLLM's post-load layout (what
// vLLM's process_weights_after_loading leaves in `weight` / `weight_scale` for
// a Marlin fp8 layer), so a vLLM layer's tensors are read as they are, with no
// conversion copy. This header is the ONE definition of the layout, of the
// e4m3 -> bf16/fp16 bit-shift dequant and of the scale permutation: the CUDA
// GEMM, the CUDA/CPU repack and the CPU reference GEMM all use these inline
// functions, so the CPU tests prove the layout the GPU reads. The same layout
// is described in mla_ext/kv_b_proj/marlin.py (a test keeps the two texts
// equal). Torch-free (kernels and CPU files include only this).
//
// Math: C[M, N] = A[M, K] · (decode(W)[N, K] · scale)^T, W float8_e4m3fn.
//
// LAYOUT BEGIN
// qweight: int32 [K/16, 4*N_pad], N_pad = N rounded up to 64 (vLLM: N % 64 == 0, so [K/16, 4N]).
//   The weight is cut into tiles of 16 k (reduction) x 64 n (output columns).
//   Tile (kt, nt) is the 256 consecutive words starting at word (kt * N_pad/64 + nt) * 256,
//   i.e. row kt of qweight holds the tiles of k-tile kt for every 64-column block (k-tiles outermost).
//   Inside a tile, word lane*8 + j (lane 0..31, j 0..7) feeds warp lane `lane` the
//   mma.sync.m16n8k16 B fragment of the j-th 8-column sub-tile; with g = lane / 4, t = lane % 4:
//     n = nt*64 + j*8 + g,  k0 = kt*16 + 2*t,
//     byte 0 = W[n][k0], byte 1 = W[n][k0+8], byte 2 = W[n][k0+1], byte 3 = W[n][k0+9]
//   (byte 0 = least significant). Columns n >= N are zero bytes.
// scales: activation dtype (bf16 or fp16, the model dtype), [G, N_pad]; G = 1 (per-channel)
//   or K/128 (group_size 128 with K > 128; group_size == K is per-channel).
//   Value: the fp32 scale times 2^120 (bf16) or 2^8 (fp16), rounded once to the activation dtype.
//   Row g holds k-group g, permuted inside blocks of columns:
//   per-channel, 32-column blocks: position 8*i + x holds column 2*i + (x % 2) + 8*(x / 2)
//     (i 0..3, x 0..7), i.e. column c sits at 8*((c % 8) / 2) + 2*((c % 32) / 8) + c % 2;
//   grouped, 64-column blocks: position 8*i + x holds column i + 8*x (an 8x8 transpose),
//     i.e. column c sits at 8*(c % 8) + c / 8.
//   Padded columns hold 0.
// LAYOUT END
//
// Why this byte order: B fragment register b0 holds (k0, k0+1) and b1 holds
// (k0+8, k0+9), lower k in the low half. With bytes (k0, k0+8, k0+1, k0+9),
// bytes 1 and 3 already sit in the high byte of each 16-bit half (b1), and a
// left shift by 8 puts bytes 0 and 2 there (b0): the dequant is masks and
// shifts only. A lane's 8 words are 32 contiguous bytes (two 16-byte loads),
// a warp reads a tile as 1 KiB of contiguous memory.
//
// Scale permutation, derived from the lanes that consume it: the m16n8k16
// accumulators of lane (g, t) are the columns j*8 + 2t + e (j 0..7, e 0..1).
// Per-channel: in 32-column block b, column 8*jj + 2t + e (jj 0..3) sits at
// position 8t + 2*jj + e, so a lane's 16 scales are positions 8t..8t+7 and
// 32+8t..32+8t+7 of the 64-column panel (two 16-byte loads). Grouped: column
// 8j + 2t + e sits at 8*(2t+e) + j, so a lane's 16 scales are positions
// 16t..16t+15 (two 16-byte loads; e = 0 first, then e = 1). (vLLM's own kernel
// reads the grouped scales per B-fragment column g instead, 8*g + j: the same
// transpose.) This kernel multiplies each group's fp32 partial sum by the
// scale (widened to fp32), for either kind.
//
// ---------------------------------------------------------------------------
// Dequant (bit shift, exponent bias carried by the scale)
// ---------------------------------------------------------------------------
// e4m3 = s eeee mmm (bias 7). The 7 e|m bits are moved into the low exponent
// bits and top mantissa bits of the 16-bit type, the sign to bit 15:
//   fp16 (s 5e 10m, bias 15): e|m -> bits 7..13; the value is x * 2^-8
//   bf16 (s 8e 7m, bias 127): e|m -> bits 4..10; the value is x * 2^-120
// This is exact for every e4m3 value, subnormals included (an e4m3 subnormal
// 0.mmm * 2^-6 lands on the wider type's subnormal 0.mmm * 2^-14 / 2^-126, i.e.
// the same factor). 0x7f / 0xff (NaN) are rejected by the repack.
// The factor 2^8 / 2^120 is folded into the scales (fold_log2). mla_ext's
// repack multiplies in fp32 and rounds once; vLLM rounds the scale to the
// activation dtype first and multiplies there, which gives the same bits
// whenever the unfolded scale is a normal number of the activation dtype
// (always for bf16; for fp16 scales >= 2^-14). The folded scale must be finite
// in the activation dtype, i.e. |scale| below about 256 (the largest finite
// bf16 is 2^128 (1 - 2^-8), fp16 65504 = 2^8 * 255.875).
//
// GEMM constraints: K % 16 == 0 (K % 128 == 0 with group_size 128); any M and
// any N (columns are padded to 64 and masked on store); CUDA: A's row stride
// (lda, elements) % 8 == 0 and A, qweight, scales 16-byte aligned (cp.async).
#pragma once

#include <cstdint>
#include <cstring>
#if !defined(__CUDACC__)
#include <vector>
#endif

#if defined(__CUDACC__)
#define MLA_MARLIN_HD __host__ __device__ __forceinline__
#else
#define MLA_MARLIN_HD inline
#endif

namespace mla_ext {
namespace marlin_fp8 {

constexpr int kTileN = 64;          // output columns per tile
constexpr int kTileK = 16;          // reduction steps per tile (one mma k16)
constexpr int kWordsPerLane = 8;    // one word per 8-column mma sub-tile
constexpr int kWordsPerTile = 32 * kWordsPerLane;  // 256 words = 1 KiB
constexpr int kGroupSize = 128;     // the only grouped scale size supported

// Activation (and dequant target) type. The values are part of the op ABI.
enum class ActKind : int { kBf16 = 0, kFp16 = 1 };
// Output element type of the GEMM.
enum class OutKind : int { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

// log2 of the exponent-bias factor folded into the scales.
MLA_MARLIN_HD constexpr int fold_log2(ActKind a) { return a == ActKind::kFp16 ? 8 : 120; }
// Right shift that moves the e|m bits from bits 8..14 to their target position.
MLA_MARLIN_HD constexpr int dequant_shift(ActKind a) { return a == ActKind::kFp16 ? 1 : 4; }

MLA_MARLIN_HD int64_t padded_n(int64_t n) { return (n + kTileN - 1) / kTileN * kTileN; }

// First word of tile (kt, nt); n_tiles = N_pad / 64 (k-tiles outermost).
MLA_MARLIN_HD int64_t tile_word(int64_t kt, int64_t nt, int64_t n_tiles) {
  return (kt * n_tiles + nt) * kWordsPerTile;
}

// Column (inside the 64-column tile) and first k (inside the 16-k tile) of
// word lane*8 + j.
MLA_MARLIN_HD int word_col(int lane, int j) { return j * 8 + lane / 4; }
MLA_MARLIN_HD int word_k0(int lane) { return (lane % 4) * 2; }
// k offset (from word_k0) of byte b of a word: 0, 8, 1, 9.
MLA_MARLIN_HD int byte_dk(int b) { return (b >> 1) + (b & 1) * 8; }

// Word `lane*8 + j` of tile (kt, nt) built from a row-major fp8 [N, K] byte
// array (row stride ldw); rows >= n_rows give zero bytes. Caller ensures K % 16 == 0.
MLA_MARLIN_HD uint32_t pack_word(const uint8_t* w, int64_t ldw, int64_t n_rows, int64_t kt,
                                 int64_t nt, int lane, int j) {
  const int64_t n = nt * kTileN + word_col(lane, j);
  if (n >= n_rows) return 0u;
  const uint8_t* row = w + n * ldw + kt * kTileK + word_k0(lane);
  uint32_t q = 0;
  for (int b = 0; b < 4; ++b) q |= static_cast<uint32_t>(row[byte_dk(b)]) << (8 * b);
  return q;
}

// Whether the scales are grouped (G > 1, 64-column transpose) or per-channel
// (G == 1, 32-column permutation). group_size == K counts as per-channel.
MLA_MARLIN_HD bool grouped_scales(int64_t K, int64_t group_size) { return group_size > 0 && group_size < K; }

// Permuted scale position (inside a 64-column panel) of column c, and back.
MLA_MARLIN_HD int scale_pos(int c, bool grouped) {
  if (grouped) return (c % 8) * 8 + c / 8;
  return (c / 32) * 32 + ((c % 8) / 2) * 8 + ((c % 32) / 8) * 2 + c % 2;
}
MLA_MARLIN_HD int scale_col(int pos, bool grouped) {
  if (grouped) return (pos % 8) * 8 + pos / 8;  // the transpose is its own inverse
  const int x = pos % 8;
  return (pos / 32) * 32 + ((pos % 32) / 8) * 2 + (x % 2) + (x / 2) * 8;
}

// The 16 scales lane t needs (columns j*8 + 2t + e, j 0..7, e 0..1) are two
// runs of 8 consecutive positions: run r (0, 1) starts at lane_scale_run(t, r),
// and column (j, e) is element lane_scale_elem(j, e) of run lane_scale_which(j, e).
MLA_MARLIN_HD constexpr int lane_scale_run(bool grouped, int t, int r) {
  return grouped ? 16 * t + 8 * r : 32 * r + 8 * t;
}
MLA_MARLIN_HD constexpr int lane_scale_which(bool grouped, int j, int e) { return grouped ? e : j / 4; }
MLA_MARLIN_HD constexpr int lane_scale_elem(bool grouped, int j, int e) { return grouped ? j : 2 * (j % 4) + e; }

// One packed word -> the two 32-bit B-fragment registers (each two 16-bit
// values of the activation type, scaled by 2^-fold): out[0] = (k0, k0+1),
// out[1] = (k0+8, k0+9), lower k in the low half. Bytes 1 and 3 (k0+8, k0+9)
// already sit in the high byte of each 16-bit half; << 8 moves bytes 0 and 2
// (k0, k0+1) there.
template <ActKind kAct>
MLA_MARLIN_HD void dequant_word(uint32_t q, uint32_t out[2]) {
  constexpr int kShift = dequant_shift(kAct);
  const uint32_t r0 = q << 8;
  out[0] = (r0 & 0x80008000u) | ((r0 & 0x7F007F00u) >> kShift);
  out[1] = (q & 0x80008000u) | ((q & 0x7F007F00u) >> kShift);
}

// The 16-bit value of byte b of a word after dequant_word: byte b (k offset
// byte_dk(b): 0, 8, 1, 9) is in register b & 1 (0: k0/k0+1, 1: k0+8/k0+9),
// half b >> 1 (0: low = lower k).
MLA_MARLIN_HD uint16_t dequant_half(const uint32_t regs[2], int b) {
  return static_cast<uint16_t>(regs[b & 1] >> ((b >> 1) * 16));
}

// Host-side decoders of the 16-bit patterns (the CPU reference works in fp32).
inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float bf16_bits_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }
inline float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7F800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}
inline float act_bits_to_float(uint16_t h, ActKind a) {
  return a == ActKind::kFp16 ? fp16_bits_to_float(h) : bf16_bits_to_float(h);
}

// Byte b of word q decoded to fp32 (still carrying the 2^-fold factor).
inline float dequant_byte(uint32_t q, int b, ActKind a) {
  uint32_t regs[2];
  if (a == ActKind::kFp16) {
    dequant_word<ActKind::kFp16>(q, regs);
  } else {
    dequant_word<ActKind::kBf16>(q, regs);
  }
  return act_bits_to_float(dequant_half(regs, b), a);
}

// Decodes one 64-column panel (tile column nt) over all of K into fp32
// panel[c * K + k] (c = column inside the tile), reading the packed words with
// the layout above; still carries the 2^-fold factor. Host only.
inline void decode_panel(const uint32_t* qweight, int64_t nt, int64_t n_tiles, int64_t K, ActKind a,
                         float* panel) {
  const int64_t k_tiles = K / kTileK;
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const uint32_t* tile = qweight + tile_word(kt, nt, n_tiles);
    for (int lane = 0; lane < 32; ++lane) {
      for (int j = 0; j < kWordsPerLane; ++j) {
        const uint32_t q = tile[lane * kWordsPerLane + j];
        const int64_t c = word_col(lane, j), k0 = kt * kTileK + word_k0(lane);
        for (int b = 0; b < 4; ++b) panel[c * K + k0 + byte_dk(b)] = dequant_byte(q, b, a);
      }
    }
  }
}

#if !defined(__CUDACC__)
// Host: calls f(n, w, s) for every real column n < N, where w is the column's
// decoded fp32 weights over K (2^-fold included) and s its group scales, fp32
// (scale of group g at s[g]; the folded factor included). Parallel over
// 64-column panels.
template <class F>
void for_each_decoded_column(const uint32_t* qweight, const uint16_t* scales, int64_t N, int64_t K,
                             int64_t group_size, ActKind a, F&& f) {
  const int64_t n_pad = padded_n(N), n_tiles = n_pad / kTileN;
  const int64_t groups = group_size > 0 ? K / group_size : 1;
  const bool grouped = grouped_scales(K, group_size);
#pragma omp parallel for
  for (int64_t nt = 0; nt < n_tiles; ++nt) {
    std::vector<float> panel(static_cast<size_t>(kTileN * K));
    std::vector<float> s(static_cast<size_t>(groups));
    decode_panel(qweight, nt, n_tiles, K, a, panel.data());
    for (int c = 0; c < kTileN && nt * kTileN + c < N; ++c) {
      for (int64_t g = 0; g < groups; ++g)
        s[g] = act_bits_to_float(scales[g * n_pad + nt * kTileN + scale_pos(c, grouped)], a);
      f(nt * kTileN + c, panel.data() + c * K, s.data());
    }
  }
}
#endif

// ---------------------------------------------------------------------------
// Launchers (plain C++; the torch bindings fill these parameter blocks)
// ---------------------------------------------------------------------------

struct RepackParams {
  const uint8_t* w;           // fp8 bytes [N, K], row stride ldw
  int64_t ldw;
  const uint16_t* scales;     // [G, N] row-major, already folded and rounded to the act dtype (bits)
  int64_t N, K, G;
  bool grouped;               // grouped_scales(K, group_size)
  uint32_t* qweight;          // out [K/16, 4*N_pad]
  uint16_t* scales_out;       // out [G, N_pad] (permuted; padded columns 0)
};

struct GemmParams {
  const uint16_t* a;          // [M, K] bf16/fp16 bits, row stride lda (elements)
  int64_t lda;
  const uint32_t* qweight;    // [K/16, 4*N_pad]
  const uint16_t* scales;     // [G, N_pad], act dtype bits
  void* c;                    // [M, N], row stride ldc (elements)
  int64_t ldc;
  int64_t M, N, K;
  int64_t group_size;         // -1 per-channel, or 128
  ActKind act;
  OutKind out;
  // Split-K (GEMM and the CPU reference): k-tiles per slice (<= 0: all of K,
  // one slice). Slice s covers k-tiles [s * slice_tiles, (s + 1) * slice_tiles).
  int64_t slice_tiles;
  // CUDA only, when the plan has split > 1: fp32 partials
  // [split, tiles, 16*mb x 64*np] and one zeroed int32 counter per output tile
  // (GemmPlan::workspace_floats / counters); each tile's last slice to finish
  // sums the partials in slice order and resets its counter to 0.
  float* workspace;
  int32_t* counters;
};

// ---------------------------------------------------------------------------
// GEMM tiling and split-K plan (marlin_fp8_gemm.cu; the CPU reference
// and the bindings use the same plan, so the CPU reproduces the slicing)
// ---------------------------------------------------------------------------
// A CTA (4 warps) computes 16*mb rows x 64*np columns over one K slice. Warps
// split the columns: a warp owns ws 8-column sub-tiles (n8) of one 64-column
// panel for all mb 16-row blocks, so each weight word is dequantized once per
// CTA and feeds mb mma.sync. np = ws / 2 (4 warps x ws x 8 = 64 * np columns).
// Accumulators per lane: 4 * mb * ws floats, twice that for grouped scales
// (a per-group partial beside the scaled sum); gemm_tiling keeps them at 64.
// Grouped: (mb, ws) = (1, 8), (2, 4), (4, 2); per-channel: (1, 8), (2, 8), (4, 4).
struct GemmTiling {
  int mb;  // 16-row blocks per CTA: 1, 2 or 4
  int ws;  // n8 sub-tiles per warp: 2, 4 or 8
  MLA_MARLIN_HD int np() const { return ws / 2; }
  MLA_MARLIN_HD int rows() const { return 16 * mb; }
  MLA_MARLIN_HD int cols() const { return 32 * ws; }
};

MLA_MARLIN_HD GemmTiling gemm_tiling(int64_t M, bool grouped) {
  if (M <= 16) return {1, 8};
  if (M <= 32) return {2, grouped ? 4 : 8};
  return {4, grouped ? 2 : 4};
}

constexpr int kStageTiles = 2;  // k-tiles per pipeline stage (32 k)
constexpr int kMaxSplit = 64;   // largest split-K the op accepts
constexpr int kAutoMaxSplit = 16;
constexpr int64_t kMaxGridY = 65535;  // row tiles per launch (more: further launches)

struct GemmPlan {
  GemmTiling tiling;
  int64_t n_ctiles;          // CTA column tiles: ceil(N_pad/64 / np)
  int64_t m_tiles;           // CTA row tiles: ceil(M / (16 * mb))
  int64_t k_tiles;           // K / 16
  int64_t split;             // split-K slices (1: no workspace)
  int64_t slice_tiles;       // k-tiles per slice, a multiple of kStageTiles (or all of K)
  int64_t workspace_floats;  // split > 1: split * tiles * rows * cols (tiles of one launch)
  int64_t counters;          // split > 1: tiles of one launch
};

// split_request: 0 = automatic (from the output tiles and sm_count; sm_count
// <= 0, e.g. on the CPU, gives 1), else that many slices (clamped to the
// k-tiles). Automatic: round(sm_count / tiles) slices, at most 16 and at
// least two k-tiles each, so that a small-M GEMM (16 tiles at N = 4096) puts
// a CTA on every SM. A slice length is a multiple of the 2-k-tile stage, so a
// stage never holds two scale-group ends (groups are 8 k-tiles).
MLA_MARLIN_HD GemmPlan plan_gemm(int64_t M, int64_t N, int64_t K, int64_t group_size, int64_t sm_count,
                                 int64_t split_request) {
  GemmPlan pl{};
  pl.tiling = gemm_tiling(M, grouped_scales(K, group_size));
  const int64_t n_tiles = padded_n(N) / kTileN;
  pl.n_ctiles = (n_tiles + pl.tiling.np() - 1) / pl.tiling.np();
  pl.m_tiles = (M + pl.tiling.rows() - 1) / pl.tiling.rows();
  pl.k_tiles = K / kTileK;
  const int64_t tiles = pl.n_ctiles * pl.m_tiles;
  int64_t s = split_request;
  if (s <= 0) {
    s = (sm_count > 0 && tiles > 0) ? (sm_count + tiles / 2) / tiles : 1;
    if (s > kAutoMaxSplit) s = kAutoMaxSplit;
    const int64_t by_k = pl.k_tiles / kStageTiles;
    if (s > by_k) s = by_k;
    // The reduction writes and re-reads one fp32 partial tile set per slice:
    // 8 * rows * cols bytes per slice. Bound it by the weight's bytes (fp8,
    // N_pad x K), so the split never moves more than the GEMM it splits (at
    // DeepSeek TP8, N = 4096, K = 512, M <= 16: 4 slices, not 8).
    const int64_t rows = (pl.m_tiles < kMaxGridY ? pl.m_tiles : kMaxGridY) * pl.tiling.rows();
    const int64_t per_slice = 8 * rows * pl.n_ctiles * pl.tiling.cols();
    const int64_t by_bytes = per_slice > 0 ? padded_n(N) * K / per_slice : s;
    if (s > by_bytes) s = by_bytes;
  }
  if (s > kMaxSplit) s = kMaxSplit;
  if (s < 1) s = 1;
  int64_t len = (pl.k_tiles + s - 1) / s;
  len = (len + kStageTiles - 1) / kStageTiles * kStageTiles;
  if (len < 1) len = 1;
  pl.split = len >= pl.k_tiles ? 1 : (pl.k_tiles + len - 1) / len;
  pl.slice_tiles = pl.split == 1 ? pl.k_tiles : len;
  if (pl.split > 1) {
    // One launch's tiles (launches beyond kMaxGridY row tiles reuse it in stream order).
    const int64_t launch_tiles = pl.n_ctiles * (pl.m_tiles < kMaxGridY ? pl.m_tiles : kMaxGridY);
    pl.workspace_floats = pl.split * launch_tiles * pl.tiling.rows() * pl.tiling.cols();
    pl.counters = launch_tiles;
  }
  return pl;
}

struct DequantParams {
  const uint32_t* qweight;
  const uint16_t* scales;     // [G, N_pad], act dtype bits
  int64_t N, K, group_size;
  ActKind act;
  float* out;                 // [N, K] fp32 contiguous
};

// k-tiles per scale group (all of K for per-channel).
MLA_MARLIN_HD int64_t group_tiles(int64_t K, int64_t group_size) {
  return group_size > 0 ? group_size / kTileK : K / kTileK;
}

// CPU (csrc/kv_b_proj/marlin_fp8_*_cpu.cpp). The GEMM writes fp32 C (p.out ignored).
// The bindings validate (NaN bytes, finite folded scales) before calling these.
void marlin_fp8_repack_cpu(const RepackParams& p);
void marlin_fp8_dequantize_cpu(const DequantParams& p);
void marlin_fp8_gemm_cpu(const GemmParams& p);

// CUDA (csrc/kv_b_proj/marlin_fp8_*.cu); `stream` is a cudaStream_t. Each
// returns the cudaError_t of its launches (0 = success) so the binding can
// raise instead of returning an unwritten output (e.g. no kernel image for
// the device's arch).
int marlin_fp8_repack_cuda(const RepackParams& p, void* stream);
int marlin_fp8_dequantize_cuda(const DequantParams& p, void* stream);
// The GEMM (split-K, multi-row-block CTAs): `plan` from plan_gemm; p.slice_tiles,
// p.workspace and p.counters filled from it (workspace/counters only when split > 1).
int marlin_fp8_gemm_cuda(const GemmParams& p, const GemmPlan& plan, void* stream);
// The SM count of a CUDA device (0 if it cannot be read); cached per device.
int marlin_fp8_device_sm_count(int device);

}  // namespace marlin_fp8
}  // namespace mla_ext
