"""The DSA indexer's key-cache formats, one per layer: bytes per token, page size, storage dtype
(mirror of csrc/common/indexer_cache_layout.h; tests/sparse/test_sparse_index_cache_cpp.py compares
both through the compiled op index_cache_format_info).

  bfloat16  cache [num_blocks, B, D] bf16; 2*D bytes per token.
  float32   cache [num_blocks, B, D] fp32; 4*D bytes per token (fp32 models; the exact-parity tests:
            transformers scores in fp32).
  fp8       vLLM 0.33's `indexer_k_quant_and_cache` layout: cache [num_blocks, B, D + 4*D/Q]
            uint8 (Q = quant_block_size, D in the published configs: one scale per token);
            a page holds first the B tokens' e4m3 values token-major (B*D bytes), then their
            fp32 scales (B*D/Q of them, token-major). So the [B, D + 4D/Q] shape of a page is
            NOT a per-token row: token j's values are at page byte j*D, its scales at
            B*D + 4*j*D/Q. Scale = max(amax(x over Q values), 1e-4) / 448, rounded up to a
            power of two when scale_fmt == "ue8m0"; stored value = e4m3(x / scale).

`IndexCacheSpec` is what the pool planner (config/planner.py) adds beside a layer's latent page.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

E4M3_MAX = 448.0
MIN_SCALE = 1e-4


@dataclass(frozen=True)
class IndexCacheFormat:
    name: str
    quantized: bool
    native_dtype: torch.dtype = torch.bfloat16

    def bytes_per_token(self, head_dim: int, quant_block_size: int | None = None) -> int:
        check_dims(head_dim, quant_block_size if self.quantized else None)
        if not self.quantized:
            return self.native_dtype.itemsize * head_dim
        return head_dim + 4 * (head_dim // (quant_block_size or head_dim))

    def page_bytes(self, block_size: int, head_dim: int, quant_block_size: int | None = None) -> int:
        return block_size * self.bytes_per_token(head_dim, quant_block_size)

    def cache_shape(self, num_blocks: int, block_size: int, head_dim: int,
                    quant_block_size: int | None = None) -> tuple[int, int, int]:
        if not self.quantized:
            return (num_blocks, block_size, head_dim)
        return (num_blocks, block_size, self.bytes_per_token(head_dim, quant_block_size))

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.native_dtype

    def empty(self, num_blocks: int, block_size: int, head_dim: int, quant_block_size: int | None = None,
              device=None) -> Tensor:
        return torch.empty(self.cache_shape(num_blocks, block_size, head_dim, quant_block_size),
                           dtype=self.storage_dtype, device=device)


FORMATS = {"bfloat16": IndexCacheFormat("bfloat16", False), "float32": IndexCacheFormat("float32", False, torch.float32),
           "fp8": IndexCacheFormat("fp8", True)}
ALIASES = {"bf16": "bfloat16", "auto": "bfloat16", "fp32": "float32", "fp8_e4m3": "fp8"}


def get_index_format(name) -> IndexCacheFormat:
    if isinstance(name, IndexCacheFormat):
        return name
    key = ALIASES.get(name, name) if isinstance(name, str) else None
    if key not in FORMATS:
        raise ValueError(f"index_cache_dtype: expected one of {sorted(FORMATS) + sorted(ALIASES)}, got {name!r}")
    return FORMATS[key]


def check_dims(head_dim, quant_block_size) -> None:
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 4:
        raise ValueError(f"head_dim: expected a positive multiple of 4, got {head_dim!r}")
    if quant_block_size is not None and (not isinstance(quant_block_size, int) or quant_block_size <= 0
                                         or head_dim % quant_block_size):
        raise ValueError(f"quant_block_size: expected a positive divisor of head_dim={head_dim}, "
                         f"got {quant_block_size!r}")


@dataclass(frozen=True)
class IndexCacheSpec:
    """One layer's index cache for the pool planner (mla_ext.config.planner.plan_pool(index_specs=)):
    its pages sit beside the latent pages, same block ids, same block size."""
    layer_index: int
    index_cache_dtype: str
    head_dim: int
    block_size: int
    quant_block_size: int | None = None

    def __post_init__(self):
        get_index_format(self.index_cache_dtype)
        check_dims(self.head_dim, self.quant_block_size if self.format.quantized else None)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size: expected a positive int, got {self.block_size!r}")

    @property
    def format(self) -> IndexCacheFormat:
        return get_index_format(self.index_cache_dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.format.bytes_per_token(self.head_dim, self.quant_block_size)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.format.storage_dtype

    def page_bytes(self, alignment: int | None = None) -> int:
        page = self.block_size * self.bytes_per_token
        return page if not alignment else -(-page // alignment) * alignment

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int]:
        return self.format.cache_shape(num_blocks, self.block_size, self.head_dim, self.quant_block_size)
