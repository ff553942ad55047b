"""vLLM's DSA indexer pads uneven decode queries (speculative decoding, short chunked prefills)
with `pack_seq_triton`, whose Triton kernel fills pads by storing an fp32 value: for the fp8
queries of the indexer that is an fp32 -> fp8e4nv conversion, which Triton has only from sm_89.
`SparseAttnIndexer.__init__` also registers that fp8 kernel for vLLM's JIT warmup (on by
default), so on capability 8.0/8.6 a DSA model's start-up fails before its first request.

Below 8.9 mla_ext's sparse plugin rebinds both (mla_ext/vllm/sparse_plugin.py ROUTES): an fp8
tensor is packed as its bytes by vLLM's own kernel (its exact-byte uint8 path), with pad byte 0
(e4m3 +0.0) where vLLM pads with the fp32 value cast to fp8 -- vLLM masks padded rows by their
context length downstream, so the pad value is never read; every other dtype goes to vLLM's
function unchanged, and the warmup registers the uint8 kernel in place of the fp8 one.
"""
from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def pack_seq_triton(x: torch.Tensor, lengths: torch.Tensor, pad_value: float | int = -float("inf"),
                    block_t: int = 64, block_d: int = 64) -> torch.Tensor:
    """vLLM's pack_seq_triton (same arguments and result), fp8 packed as bytes (module docstring)."""
    from vllm.v1.attention.ops.common import pack_seq_triton as vllm_pack_seq_triton

    if x.dtype in FP8:
        packed = vllm_pack_seq_triton(x.view(torch.uint8), lengths, pad_value=0, block_t=block_t, block_d=block_d)
        return packed.view(x.dtype)
    return vllm_pack_seq_triton(x, lengths, pad_value=pad_value, block_t=block_t, block_d=block_d)


class PackKernelWithoutFp8Warmup:
    """Stands for vLLM's `_PACK_SEQ_TRITON_KERNEL` below sm_89: an fp8 warmup registration becomes
    the uint8 one pack_seq_triton above launches; everything else is the kernel's own."""

    def __init__(self, kernel):
        self._kernel = kernel

    def register_warmup(self, *args, dtype: torch.dtype | None = None, pad_value: float | int = 0, **kwargs):
        if dtype in FP8:
            dtype, pad_value = torch.uint8, 0
        return self._kernel.register_warmup(*args, dtype=dtype, pad_value=pad_value, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._kernel(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def without_fp8_warmup(kernel) -> PackKernelWithoutFp8Warmup:
    """The route's wrapper of vLLM's kernel object (sparse_plugin: Route.wraps)."""
    return kernel if isinstance(kernel, PackKernelWithoutFp8Warmup) else PackKernelWithoutFp8Warmup(kernel)
