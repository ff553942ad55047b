// The DSA indexer key cache formats (one cache per layer beside the latent cache).
// Mirror: mla_ext/sparse/index_cache.py (tests/test_sparse_index_cache.py parses this
// header and checks both agree).
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

static_assert(bytes_per_token(IndexFormat::kFp8, 128, 128) == 132, "vLLM: 128 e4m3 + one fp32 scale");
static_assert(page_bytes(IndexFormat::kBf16, 64, 128, 128) == 16384, "bf16 page");

}  // namespace indexer_cache
}  // namespace mla_ext
