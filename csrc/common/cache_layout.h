// The one C++ truth for the paged latent-cache formats (SPEC §2).
//
// Everything a kernel needs to know about a cache row lives here: the format
// ids, their string names and aliases, bytes per token, quantisation mode and
// the fp8_ds_mla / nvfp4_ds_mla byte offsets. mla_ext/config/formats.py mirrors this
// header and tests/test_formats.py proves the two agree for every format and
// several (L, R) through the `mla_ext::format_info` op.
//
// Torch-free on purpose: kernels (.cu and CPU .cpp) include it without paying
// for torch headers.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MLA_HOST_DEVICE __host__ __device__
#else
#define MLA_HOST_DEVICE
#endif

namespace mla_ext {

// Stable numeric ids; the Python mirror uses the same numbers.
enum class CacheFormat : int32_t {
  kAuto = 0,      // the model dtype (bf16, fp16 or fp32), no quantisation
  kBFloat16 = 1,  // explicit bf16
  kFloat16 = 2,   // explicit fp16
  kFp8E4M3 = 3,   // "fp8", "fp8_e4m3": e4m3 bytes, one per-tensor K scale
  kFp8E5M2 = 4,   // "fp8_e5m2": e5m2 bytes, one per-tensor K scale
  kFp8DsMla = 5,  // DeepSeek's 656-byte row: e4m3 kv_c + 4 tile scales + bf16 k_pe
  kNvfp4DsMla = 6,  // 352-byte row: e2m1 kv_c + e4m3 rope + 32 permuted e4m3 block scales
};
constexpr int kNumCacheFormats = 7;

enum class QuantMode : int32_t {
  kNone = 0,
  kFp8PerTensor = 1,
  kFp8PerTile = 2,
  kNvfp4PerBlock = 3,
};

enum class ScaleKind : int32_t {
  kNone = 0,       // no scale
  kPerTensor = 1,  // one fp32 K scale passed beside the cache
  kPerTile = 2,    // fp32 scales stored inside each cache row
  kPerBlock = 3,   // e4m3 scales stored inside each cache row, one per 16 values
};

// fp8_ds_mla row layout (bytes). Only defined for L = 512, R in {64, 0}.
namespace ds_mla {
constexpr int kLatentDim = 512;    // L
constexpr int kRopeDim = 64;       // R (R = 0 keeps the bytes, zero-filled)
constexpr int kTileSize = 128;     // values per scale tile
constexpr int kNumTiles = kLatentDim / kTileSize;  // 4
constexpr int kLatentOffset = 0;                   // 512 x e4m3
constexpr int kScaleOffset = kLatentDim;           // 512: 4 x fp32
constexpr int kRopeOffset = kScaleOffset + 4 * kNumTiles;  // 528: 64 x bf16
constexpr int kEntryBytes = kRopeOffset + 2 * kRopeDim;    // 656
constexpr float kE4M3Max = 448.0f;
constexpr float kMinScale = 1e-4f;  // floor of amax / 448 before rounding to 2^k
static_assert(kEntryBytes == 656, "fp8_ds_mla rows are 656 bytes");
}  // namespace ds_mla

// nvfp4_ds_mla row layout (bytes). Only defined for L = 512, R = 64.
//   [0, 256)    512 latent values as e2m1, two per byte: element 2j in the low
//               nibble of byte j, element 2j+1 in the high nibble; bit 3 of a
//               nibble is the sign, bits 0-2 index the magnitudes
//               0, .5, 1, 1.5, 2, 3, 4, 6.
//   [256, 320)  64 rope values as e4m3, no scale (saturating cast).
//   [320, 352)  32 e4m3 block scales, one per 16 latent values, permuted: the
//               scale of block s (elements [16 s, 16 s + 16)) is at byte
//               320 + scale_byte(s) = 320 + 8 * (s & 3) + (s >> 2).
// Block scale = e4m3(max(amax16 / 6, 2^-9)) (round to nearest even,
// saturating at 448); a latent value is stored as x / scale rounded to the
// nearest e2m1 value, ties to the even code, saturating at +-6. A block
// holding a NaN or an infinity stores the e4m3 NaN byte 0x7F as its scale and
// all-zero codes, so it decodes to NaN (e2m1 has no NaN of its own).
namespace nvfp4_ds_mla {
constexpr int kLatentDim = 512;   // L
constexpr int kRopeDim = 64;      // R (exactly 64)
constexpr int kBlockSize = 16;    // latent values per e4m3 scale
constexpr int kNumBlocks = kLatentDim / kBlockSize;  // 32
constexpr int kLatentOffset = 0;                     // 256 bytes of e2m1 pairs
constexpr int kLatentBytes = kLatentDim / 2;         // 256
constexpr int kRopeOffset = kLatentOffset + kLatentBytes;  // 256: 64 x e4m3
constexpr int kScaleOffset = kRopeOffset + kRopeDim;       // 320: 32 x e4m3
constexpr int kEntryBytes = kScaleOffset + kNumBlocks;     // 352
constexpr float kE2M1Max = 6.0f;
constexpr float kMinScale = 0.001953125f;  // 2^-9, the smallest e4m3 subnormal
constexpr uint8_t kNanScaleByte = 0x7F;    // scale of a block with NaN/inf inputs
static_assert(kEntryBytes == 352, "nvfp4_ds_mla rows are 352 bytes");

// Byte (relative to kScaleOffset) holding the scale of latent block s.
MLA_HOST_DEVICE constexpr int scale_byte(int s) { return 8 * (s & 3) + (s >> 2); }
}  // namespace nvfp4_ds_mla

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;

struct FormatName {
  const char* name;
  CacheFormat format;
};

// Every accepted spelling. The first spelling of each format is canonical.
constexpr FormatName kFormatNames[] = {
    {"auto", CacheFormat::kAuto},
    {"bfloat16", CacheFormat::kBFloat16},
    {"bf16", CacheFormat::kBFloat16},
    {"float16", CacheFormat::kFloat16},
    {"fp16", CacheFormat::kFloat16},
    {"half", CacheFormat::kFloat16},
    {"fp8", CacheFormat::kFp8E4M3},
    {"fp8_e4m3", CacheFormat::kFp8E4M3},
    {"fp8_e5m2", CacheFormat::kFp8E5M2},
    {"fp8_ds_mla", CacheFormat::kFp8DsMla},
    {"nvfp4_ds_mla", CacheFormat::kNvfp4DsMla},
};
constexpr int kNumFormatNames = sizeof(kFormatNames) / sizeof(kFormatNames[0]);

// Returns false when `name` is not a known spelling.
inline bool parse_cache_format(const char* name, CacheFormat* out) {
  for (int i = 0; i < kNumFormatNames; ++i) {
    if (std::strcmp(name, kFormatNames[i].name) == 0) {
      *out = kFormatNames[i].format;
      return true;
    }
  }
  return false;
}

MLA_HOST_DEVICE constexpr QuantMode quant_mode(CacheFormat f) {
  return f == CacheFormat::kFp8E4M3 || f == CacheFormat::kFp8E5M2 ? QuantMode::kFp8PerTensor
         : f == CacheFormat::kFp8DsMla                            ? QuantMode::kFp8PerTile
         : f == CacheFormat::kNvfp4DsMla                          ? QuantMode::kNvfp4PerBlock
                                                                  : QuantMode::kNone;
}

MLA_HOST_DEVICE constexpr ScaleKind scale_kind(CacheFormat f) {
  return f == CacheFormat::kFp8E4M3 || f == CacheFormat::kFp8E5M2 ? ScaleKind::kPerTensor
         : f == CacheFormat::kFp8DsMla                            ? ScaleKind::kPerTile
         : f == CacheFormat::kNvfp4DsMla                          ? ScaleKind::kPerBlock
                                                                  : ScaleKind::kNone;
}

MLA_HOST_DEVICE constexpr bool is_quantized(CacheFormat f) {
  return quant_mode(f) != QuantMode::kNone;
}

// Bytes of one cache element as stored (the tensor's element size):
// `model_elem_bytes` is the model dtype's size, used by kAuto.
MLA_HOST_DEVICE constexpr int storage_elem_bytes(CacheFormat f, int model_elem_bytes) {
  return f == CacheFormat::kAuto ? model_elem_bytes
         : (f == CacheFormat::kBFloat16 || f == CacheFormat::kFloat16) ? 2
                                                                        : 1;
}

// Dims are int64 everywhere: a caller's L or R past 2^31 must not wrap into a
// supported value (format_info("fp8_ds_mla", 2^32 + 512, 64) once answered 656).
// True when the format can hold rows of latent width L and rope width R.
MLA_HOST_DEVICE constexpr bool supports_dims(CacheFormat f, int64_t L, int64_t R) {
  return L > 0 && R >= 0 &&
         (f != CacheFormat::kFp8DsMla ||
          (L == ds_mla::kLatentDim && (R == ds_mla::kRopeDim || R == 0))) &&
         (f != CacheFormat::kNvfp4DsMla ||
          (L == nvfp4_ds_mla::kLatentDim && R == nvfp4_ds_mla::kRopeDim));
}

// Bytes one token occupies in a page (SPEC §4); -1 when the dims are not
// supported by the format.
MLA_HOST_DEVICE constexpr int64_t bytes_per_token(CacheFormat f, int64_t L, int64_t R,
                                                  int model_elem_bytes) {
  return !supports_dims(f, L, R)          ? -1
         : f == CacheFormat::kFp8DsMla   ? static_cast<int64_t>(ds_mla::kEntryBytes)
         : f == CacheFormat::kNvfp4DsMla ? static_cast<int64_t>(nvfp4_ds_mla::kEntryBytes)
                                         : (L + R) * storage_elem_bytes(f, model_elem_bytes);
}

// Elements per cache entry along the last dim of `[num_blocks, B, entry]`.
MLA_HOST_DEVICE constexpr int64_t entry_elems(CacheFormat f, int64_t L, int64_t R,
                                              int model_elem_bytes) {
  return f == CacheFormat::kFp8DsMla     ? static_cast<int64_t>(ds_mla::kEntryBytes)
         : f == CacheFormat::kNvfp4DsMla ? static_cast<int64_t>(nvfp4_ds_mla::kEntryBytes)
                                         : L + R;
}

}  // namespace mla_ext
