// Marlin-style packed FP8 (W8A16) weights for kv_b_proj: the ONE definition of
// the packed layout, the e4m3 -> bf16/fp16 bit-shift dequant and the scale
// permutation. The CUDA GEMM, the CUDA/CPU repack and the CPU reference GEMM all
// use these inline functions, so the CPU tests prove the layout the GPU reads.
// Torch-free (kernels and CPU files include only this).
//
// Math: C[M, N] = A[M, K] · (decode(W)[N, K] · scale)^T, W float8_e4m3fn.
//
// ---------------------------------------------------------------------------
// qweight layout (int32, shape [N_pad / 64, 16 * K], N_pad = N rounded up to 64)
// ---------------------------------------------------------------------------
// The weight is cut into tiles of 64 output columns (n) × 16 reduction steps
// (k). Tile (nt, kt) is 256 consecutive int32 words starting at word
//   (nt * (K / 16) + kt) * 256,
// so one 64-column panel is contiguous over all of K (a CTA streams it front to
// back). Inside a tile, word  lane * 8 + j  (lane 0..31, j 0..7) is exactly what
// warp lane `lane` needs for the mma.sync.m16n8k16 B fragment of the j-th
// 8-column sub-tile: with g = lane / 4, t = lane % 4,
//   n = nt*64 + j*8 + g,  k0 = kt*16 + 2*t,
//   byte 0 = W[n][k0], byte 1 = W[n][k0+1], byte 2 = W[n][k0+8], byte 3 = W[n][k0+9]
// (byte 0 = least significant). B fragment register b0 holds k0, k0+1 and b1
// holds k0+8, k0+9 (low half = lower k), so one word dequantizes into the two
// B registers with byte moves and masks only. A lane's 8 words are 32
// contiguous bytes (two 16-byte loads) and a warp reads a tile as 1 KiB of
// contiguous memory. Columns n >= N are zero bytes (decode to +0).
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
// The factor 2^8 / 2^120 is folded into the scales (kFoldLog2).
//
// ---------------------------------------------------------------------------
// scales layout (fp32, shape [G, N_pad]; G = 1 per-channel, K / 128 group-128)
// ---------------------------------------------------------------------------
// Row g holds the scale of k-group g (all of K for per-channel) times 2^fold,
// permuted inside every 64-column block so that the 16 scales one lane's
// accumulators need (columns j*8 + 2*t + e, j 0..7, e 0..1) are 16 consecutive
// floats starting at position t*16 (four 16-byte loads):
//   position(t, j, e) = t*16 + j*2 + e  <->  column j*8 + t*2 + e.
// Padded columns hold 0. Scales stay fp32 (not the activation dtype): they are
// applied to fp32 partial sums in the epilogue, so rounding them to bf16 would
// only lose accuracy, and fp16 could not hold scale * 2^8 for scales >= 256.
// The folded value must be finite in fp32: |scale| * 2^120 < 2^128 for bf16,
// i.e. |scale| < 256 (fp8 weight scales are amax/448, far smaller).
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

// First word of tile (nt, kt).
MLA_MARLIN_HD int64_t tile_word(int64_t nt, int64_t kt, int64_t k_tiles) {
  return (nt * k_tiles + kt) * kWordsPerTile;
}

// Column (inside the 64-column tile) and first k (inside the 16-k tile) of
// word lane*8 + j.
MLA_MARLIN_HD int word_col(int lane, int j) { return j * 8 + lane / 4; }
MLA_MARLIN_HD int word_k0(int lane) { return (lane % 4) * 2; }
// k offset (from word_k0) of byte b of a word.
MLA_MARLIN_HD int byte_dk(int b) { return (b & 1) + (b >> 1) * 8; }

// Word `lane*8 + j` of tile (nt, kt) built from a row-major fp8 [N, K] byte
// array (row stride ldw); rows >= n give zero bytes. Caller ensures K % 16 == 0.
MLA_MARLIN_HD uint32_t pack_word(const uint8_t* w, int64_t ldw, int64_t n_rows, int64_t nt,
                                 int64_t kt, int lane, int j) {
  const int64_t n = nt * kTileN + word_col(lane, j);
  if (n >= n_rows) return 0u;
  const uint8_t* row = w + n * ldw + kt * kTileK + word_k0(lane);
  uint32_t q = 0;
  for (int b = 0; b < 4; ++b) q |= static_cast<uint32_t>(row[byte_dk(b)]) << (8 * b);
  return q;
}

// Permuted scale position (inside a 64-column block) of column c, and back.
MLA_MARLIN_HD int scale_pos(int c) { return ((c % 8) / 2) * 16 + (c / 8) * 2 + (c % 2); }
MLA_MARLIN_HD int scale_col(int pos) {
  const int t = pos / 16, j = (pos % 16) / 2, e = pos % 2;
  return j * 8 + t * 2 + e;
}

// One packed word -> the two 32-bit B-fragment registers (each two 16-bit
// values of the activation type, scaled by 2^-fold): out[0] = (k0, k0+1),
// out[1] = (k0+8, k0+9), lower k in the low half.
template <ActKind kAct>
MLA_MARLIN_HD void dequant_word(uint32_t q, uint32_t out[2]) {
#if defined(__CUDA_ARCH__)
  // Byte moves in one instruction each: bytes 0,1 (resp. 2,3) into the high
  // byte of each 16-bit half, zero (selector 4 = byte 0 of the 0 operand) below.
  const uint32_t r0 = __byte_perm(q, 0u, 0x1404);
  const uint32_t r1 = __byte_perm(q, 0u, 0x3424);
#else
  const uint32_t r0 = ((q & 0x000000FFu) << 8) | ((q & 0x0000FF00u) << 16);
  const uint32_t r1 = ((q & 0x00FF0000u) >> 8) | (q & 0xFF000000u);
#endif
  constexpr int kShift = dequant_shift(kAct);
  out[0] = (r0 & 0x80008000u) | ((r0 & 0x7F007F00u) >> kShift);
  out[1] = (r1 & 0x80008000u) | ((r1 & 0x7F007F00u) >> kShift);
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
  const uint16_t h = static_cast<uint16_t>(regs[b >> 1] >> ((b & 1) * 16));
  return act_bits_to_float(h, a);
}

// Decodes one 64-column panel (tile column nt) over all of K into fp32
// panel[c * K + k] (c = column inside the tile), reading the packed words with
// the layout above; still carries the 2^-fold factor. Host only.
inline void decode_panel(const uint32_t* qweight, int64_t nt, int64_t K, ActKind a, float* panel) {
  const int64_t k_tiles = K / kTileK;
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const uint32_t* tile = qweight + tile_word(nt, kt, k_tiles);
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
// decoded fp32 weights over K (2^-fold included) and s its first packed scale
// (group g at s[g * N_pad]). Parallel over 64-column panels.
template <class F>
void for_each_decoded_column(const uint32_t* qweight, const float* scales, int64_t N, int64_t K, ActKind a,
                             F&& f) {
  const int64_t n_tiles = padded_n(N) / kTileN;
#pragma omp parallel for
  for (int64_t nt = 0; nt < n_tiles; ++nt) {
    std::vector<float> panel(static_cast<size_t>(kTileN * K));
    decode_panel(qweight, nt, K, a, panel.data());
    for (int c = 0; c < kTileN && nt * kTileN + c < N; ++c)
      f(nt * kTileN + c, panel.data() + c * K, scales + nt * kTileN + scale_pos(c));
  }
}
#endif

// ---------------------------------------------------------------------------
// Launchers (plain C++; the torch bindings fill these parameter blocks)
// ---------------------------------------------------------------------------

struct RepackParams {
  const uint8_t* w;        // fp8 bytes [N, K], row stride ldw
  int64_t ldw;
  const float* scales;     // [G, N] row-major fp32 (unfolded)
  int64_t N, K, G;
  ActKind act;
  uint32_t* qweight;       // out [N_pad/64, 16*K]
  float* scales_out;       // out [G, N_pad] (permuted, folded)
};

struct GemmParams {
  const uint16_t* a;       // [M, K] bf16/fp16 bits, row stride lda (elements)
  int64_t lda;
  const uint32_t* qweight;
  const float* scales;     // packed [G, N_pad]
  void* c;                 // [M, N], row stride ldc (elements)
  int64_t ldc;
  int64_t M, N, K;
  int64_t group_size;      // -1 per-channel, or 128
  ActKind act;
  OutKind out;
};

struct DequantParams {
  const uint32_t* qweight;
  const float* scales;     // packed [G, N_pad]
  int64_t N, K, group_size;
  ActKind act;
  float* out;              // [N, K] fp32 contiguous
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
int marlin_fp8_gemm_cuda(const GemmParams& p, void* stream);

}  // namespace marlin_fp8
}  // namespace mla_ext
