// CPU kernels of the paged latent cache ops: OpenMP over rows, straight
// loops; fp8 decode goes through 256-entry tables built once per call so the
// inner loop is a byte-indexed load (no per-element float math).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cache/cache_kernels.h"
#include "cache/nvfp4_ds_mla.h"
#include "common/fp8.h"

namespace mla_ext {
namespace cache {
namespace {

using fp8::decode_e4m3;
using fp8::decode_e5m2;

// Destination element types: storage type and rounding from fp32.
struct OutBF16 {
  using T = uint16_t;
  static T from(float x) { return fp8::f32_to_bf16_bits(x); }
};
struct OutF16 {
  using T = uint16_t;
  static T from(float x) { return fp8::f32_to_f16_bits(x); }
};
struct OutF32 {
  using T = float;
  static T from(float x) { return x; }
};

inline float load_f32(const uint8_t* row, ElemType t, int64_t i) {
  switch (t) {
    case ElemType::kBF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * i, 2);
      return fp8::bf16_bits_to_f32(h);
    }
    case ElemType::kF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * i, 2);
      return fp8::f16_bits_to_f32(h);
    }
    default: {
      float f;
      std::memcpy(&f, row + 4 * i, 4);
      return f;
    }
  }
}

struct Tables {
  float e4m3[256];
  float e5m2[256];
  Tables() {
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = decode_e4m3(static_cast<uint8_t>(b));
      e5m2[b] = decode_e5m2(static_cast<uint8_t>(b));
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

// Rows [lo, hi) of dst that some request owns (see find_request).
inline void gather_row_range(const GatherParams& p, int64_t* lo, int64_t* hi) {
  *lo = p.num_reqs > 0 ? std::max<int64_t>(p.cu_seq_lens[0], 0) : 0;
  *hi = p.num_reqs > 0 ? std::min<int64_t>(p.cu_seq_lens[p.num_reqs], p.dst_rows) : 0;
}

void gather_raw(const GatherParams& p) {
  int64_t lo, hi;
  gather_row_range(p, &lo, &hi);
#pragma omp parallel for schedule(static)
  for (int64_t t = lo; t < hi; ++t) {
    const uint8_t* src = gather_source_row(p, t);
    uint8_t* dst = p.dst + t * p.dst_row_stride;
    if (src) std::memcpy(dst, src, static_cast<size_t>(p.row_bytes));
    else std::memset(dst, 0, static_cast<size_t>(p.row_bytes));
  }
}

// Dequantizing gathers: decode(src, dst) for every dst row a request owns
// (OpenMP over rows); a row without a source (out-of-range block) is zeroed.
template <class T, class Decode>
void for_each_gathered_row(const GatherParams& p, const Decode& decode) {
  int64_t lo, hi;
  gather_row_range(p, &lo, &hi);
#pragma omp parallel for schedule(static)
  for (int64_t t = lo; t < hi; ++t) {
    const uint8_t* src = gather_source_row(p, t);
    T* dst = reinterpret_cast<T*>(p.dst + t * p.dst_row_stride);
    if (src) decode(src, dst);
    else std::memset(dst, 0, sizeof(T) * static_cast<size_t>(p.width));
  }
}

template <class Out>
void gather_per_tensor(const GatherParams& p, const float* decode) {
  using T = typename Out::T;
  T lut[256];  // decode(b) * scale, already rounded to the output type
  const float scale = checked_k_scale(*p.k_scale);
  for (int b = 0; b < 256; ++b) lut[b] = Out::from(decode[b] * scale);
  const int64_t w = p.width;
  for_each_gathered_row<T>(p, [&](const uint8_t* src, T* dst) {
    for (int64_t i = 0; i < w; ++i) dst[i] = lut[src[i]];
  });
}

template <class Out>
void gather_ds_mla(const GatherParams& p) {
  using T = typename Out::T;
  const float* dec = tables().e4m3;
  const int64_t rope = p.width - ds_mla::kLatentDim;  // 64 or 0
  for_each_gathered_row<T>(p, [&](const uint8_t* src, T* dst) {
    float scales[ds_mla::kNumTiles];
    std::memcpy(scales, src + ds_mla::kScaleOffset, sizeof(scales));
    for (int tile = 0; tile < ds_mla::kNumTiles; ++tile) {
      const uint8_t* q = src + ds_mla::kLatentOffset + tile * ds_mla::kTileSize;
      T* d = dst + tile * ds_mla::kTileSize;
      const float s = scales[tile];
      for (int i = 0; i < ds_mla::kTileSize; ++i) d[i] = Out::from(dec[q[i]] * s);
    }
    const uint8_t* pe = src + ds_mla::kRopeOffset;
    for (int64_t i = 0; i < rope; ++i) {
      uint16_t h;
      std::memcpy(&h, pe + 2 * i, 2);
      dst[ds_mla::kLatentDim + i] = Out::from(fp8::bf16_bits_to_f32(h));
    }
  });
}

// nvfp4_ds_mla rows -> 576 values: latent element i = e2m1(nibble i) x the
// e4m3 scale of block i / 16 (read at its permuted byte), rope = e4m3 values.
// Every product is exact in fp32 (2 x 4 significant bits) and in bf16/fp16.
template <class Out>
void gather_nvfp4_ds_mla(const GatherParams& p) {
  namespace nv = nvfp4_ds_mla;
  using T = typename Out::T;
  const float* dec = tables().e4m3;
  float e2m1[16];
  for (uint32_t c = 0; c < 16; ++c) e2m1[c] = nv::decode_e2m1(c);
  for_each_gathered_row<T>(p, [&](const uint8_t* src, T* dst) {
    for (int b = 0; b < nv::kNumBlocks; ++b) {
      const float s = dec[src[nv::kScaleOffset + nv::scale_byte(b)]];
      const uint8_t* q = src + nv::kLatentOffset + b * (nv::kBlockSize / 2);
      T* d = dst + b * nv::kBlockSize;
      for (int j = 0; j < nv::kBlockSize / 2; ++j) {
        d[2 * j] = Out::from(e2m1[q[j] & 0xF] * s);
        d[2 * j + 1] = Out::from(e2m1[q[j] >> 4] * s);
      }
    }
    const uint8_t* pe = src + nv::kRopeOffset;
    for (int i = 0; i < nv::kRopeDim; ++i) dst[nv::kLatentDim + i] = Out::from(dec[pe[i]]);
  });
}

template <class Out>
void gather_dequant(const GatherParams& p) {
  switch (p.kind) {
    case GatherKind::kFp8E4M3: return gather_per_tensor<Out>(p, tables().e4m3);
    case GatherKind::kFp8E5M2: return gather_per_tensor<Out>(p, tables().e5m2);
    case GatherKind::kNvfp4DsMla: return gather_nvfp4_ds_mla<Out>(p);
    default: return gather_ds_mla<Out>(p);
  }
}

void write_row_per_tensor(const WriteParams& p, int64_t t, uint8_t* dst) {
  const float scale = checked_k_scale(*p.k_scale);
  const bool e4m3 = p.format == CacheFormat::kFp8E4M3;
  const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
  const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
  for (int64_t i = 0; i < p.L + p.R; ++i) {
    const float x = i < p.L ? load_f32(kv, p.in_type, i) : load_f32(pe, p.in_type, i - p.L);
    dst[i] = e4m3 ? fp8::encode_e4m3_sat(x / scale) : fp8::encode_e5m2_sat(x / scale);
  }
}

void write_row_ds_mla(const WriteParams& p, int64_t t, uint8_t* dst) {
  const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
  float x[ds_mla::kLatentDim];
  for (int i = 0; i < ds_mla::kLatentDim; ++i) x[i] = load_f32(kv, p.in_type, i);
  float scales[ds_mla::kNumTiles];
  for (int tile = 0; tile < ds_mla::kNumTiles; ++tile) {
    const float* v = x + tile * ds_mla::kTileSize;
    float amax = 0.0f;
    for (int i = 0; i < ds_mla::kTileSize; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float s = fp8::ds_mla_tile_scale(amax, ds_mla::kE4M3Max, ds_mla::kMinScale);
    scales[tile] = s;
    uint8_t* q = dst + ds_mla::kLatentOffset + tile * ds_mla::kTileSize;
    for (int i = 0; i < ds_mla::kTileSize; ++i) q[i] = fp8::encode_e4m3_sat(v[i] / s);
  }
  std::memcpy(dst + ds_mla::kScaleOffset, scales, sizeof(scales));
  uint8_t* rope = dst + ds_mla::kRopeOffset;
  if (p.R == 0) {
    std::memset(rope, 0, 2 * ds_mla::kRopeDim);
    return;
  }
  const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
  for (int64_t i = 0; i < p.R; ++i) {
    const uint16_t h = p.in_type == ElemType::kBF16
                           ? static_cast<uint16_t>(pe[2 * i] | (pe[2 * i + 1] << 8))
                           : fp8::f32_to_bf16_bits(load_f32(pe, p.in_type, i));
    std::memcpy(rope + 2 * i, &h, 2);
  }
}

void write_row_nvfp4_ds_mla(const WriteParams& p, int64_t t, uint8_t* dst) {
  namespace nv = nvfp4_ds_mla;
  const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
  for (int b = 0; b < nv::kNumBlocks; ++b) {
    float x[nv::kBlockSize];
    for (int j = 0; j < nv::kBlockSize; ++j) x[j] = load_f32(kv, p.in_type, b * nv::kBlockSize + j);
    uint32_t w[2];
    dst[nv::kScaleOffset + nv::scale_byte(b)] = nv::encode_block(x, w);
    uint8_t* q = dst + nv::kLatentOffset + b * (nv::kBlockSize / 2);
    for (int j = 0; j < nv::kBlockSize / 2; ++j) q[j] = static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
  }
  const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
  for (int i = 0; i < nv::kRopeDim; ++i) dst[nv::kRopeOffset + i] = fp8::encode_e4m3_sat(load_f32(pe, p.in_type, i));
}

}  // namespace

void gather_cpu(const GatherParams& p) {
  if (p.kind == GatherKind::kRaw) return gather_raw(p);
  switch (p.dst_type) {
    case ElemType::kBF16: return gather_dequant<OutBF16>(p);
    case ElemType::kF16: return gather_dequant<OutF16>(p);
    default: return gather_dequant<OutF32>(p);
  }
}

void write_cpu(const WriteParams& p) {
  const int eb = elem_bytes(p.in_type);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    uint8_t* dst = write_dest_row(p, t);
    if (!dst) continue;
    switch (quant_mode(p.format)) {
      case QuantMode::kNone:
        std::memcpy(dst, p.kv_c + t * p.kv_c_row_stride, static_cast<size_t>(p.L) * eb);
        std::memcpy(dst + p.L * eb, p.k_pe + t * p.k_pe_row_stride,
                    static_cast<size_t>(p.R) * eb);
        break;
      case QuantMode::kFp8PerTensor: write_row_per_tensor(p, t, dst); break;
      case QuantMode::kFp8PerTile: write_row_ds_mla(p, t, dst); break;
      case QuantMode::kNvfp4PerBlock: write_row_nvfp4_ds_mla(p, t, dst); break;
    }
  }
}

void kv_scale_cpu(const KvScaleParams& p) {
  float amax = 0.0f;
#pragma omp parallel for schedule(static) reduction(max : amax)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
    const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
    for (int64_t i = 0; i < p.L + p.R; ++i) {
      const float a = std::fabs(i < p.L ? load_f32(kv, p.in_type, i) : load_f32(pe, p.in_type, i - p.L));
      if (std::isfinite(a)) amax = std::max(amax, a);  // non-finite values are ignored
    }
  }
  *p.out = std::max(amax / p.fp8_max, kMinKvScale);
}

}  // namespace cache
}  // namespace mla_ext
