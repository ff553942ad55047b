// The DSA indexer key cache formats (one cache per layer beside the latent cache).
// The single definition the CPU (csrc/sparse/index_cache_cpu.cpp) and CUDA
// (csrc/sparse/index_cache.cu) kernels use; mla_ext/sparse/index_cache.py mirrors it and
// tests/test_sparse_index_cache_cpp.py compares both through the compiled
// `index_cache_format_info` op (tests/test_sparse_index_cache.py also parses this text).
//
//   bfloat16: [num_blocks, B, D] bf16, 2*D bytes per token.
//   float32:  [num_blocks, B, D] fp32, 4*D bytes per token.
//   fp8 (vLLM's indexer_k_quant_and_cache layout): a page of B tokens holds first their
//     e4m3 values token-major (B*D bytes), then their fp32 scales (D/Q per token,
//     token-major); D + 4*D/Q bytes per token. scale = max(amax over Q values, 1e-4) / 448,
//     rounded up to a power of two for the "ue8m0" scale format.
#pragma once

namespace mla_ext {
namespace indexer_cache {

enum class IndexFormat : int { kBf16 = 0, kFp8 = 1, kFp32 = 2 };

constexpr float kE4M3Max = 448.0f;
constexpr float kMinScale = 1e-4f;

constexpr int bytes_per_token(IndexFormat f, int head_dim, int quant_block_size) {
  return f == IndexFormat::kBf16   ? 2 * head_dim
         : f == IndexFormat::kFp32 ? 4 * head_dim
                                   : head_dim + 4 * (head_dim / quant_block_size);
}

constexpr long long page_bytes(IndexFormat f, int block_size, int head_dim, int quant_block_size) {
  return static_cast<long long>(block_size) * bytes_per_token(f, head_dim, quant_block_size);
}

// Byte offset, inside a page, of token j's first value and of its first scale (fp8 only).
constexpr long long value_offset(int j, int head_dim) { return static_cast<long long>(j) * head_dim; }
constexpr long long scale_offset(int j, int block_size, int head_dim, int quant_block_size) {
  return static_cast<long long>(block_size) * head_dim + 4LL * j * (head_dim / quant_block_size);
}

// Format names the ops accept (canonical names, then aliases): as index_cache.py's
// FORMATS / ALIASES.
struct IndexFormatName {
  const char* name;
  IndexFormat format;
};
constexpr IndexFormatName kIndexFormatNames[] = {
    {"bfloat16", IndexFormat::kBf16}, {"float32", IndexFormat::kFp32}, {"fp8", IndexFormat::kFp8},
    {"bf16", IndexFormat::kBf16},     {"auto", IndexFormat::kBf16},    {"fp32", IndexFormat::kFp32},
    {"fp8_e4m3", IndexFormat::kFp8},
};
constexpr int kNumIndexFormatNames = sizeof(kIndexFormatNames) / sizeof(kIndexFormatNames[0]);

// Bytes of one element of the cache tensor (uint8 for fp8: values and scales share a page).
constexpr int storage_elem_bytes(IndexFormat f) {
  return f == IndexFormat::kBf16 ? 2 : (f == IndexFormat::kFp32 ? 4 : 1);
}

static_assert(bytes_per_token(IndexFormat::kFp8, 128, 128) == 132, "vLLM: 128 e4m3 + one fp32 scale");
static_assert(page_bytes(IndexFormat::kBf16, 64, 128, 128) == 16384, "bf16 page");

}  // namespace indexer_cache
}  // namespace mla_ext
