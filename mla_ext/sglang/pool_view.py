"""SGLang's MLA KV pool read as it is, in mla_ext's terms (imported by SGLang's process only).

SGLang keeps one token-granular tensor per layer, ``[size + page_size, 1, D]``
indexed by flat slot (``size`` is a multiple of ``page_size``; slot
``p * page_size + i`` is token i of page p), and ``req_to_token[req, pos]``
holds each request's slots. So without a copy:

* the layer's cache is ``buffer.view(-1, page_size, D)``, mla_ext's paged layout;
* a request's block table is ``req_to_token[req, ::page_size] // page_size``
  (SGLang's paged allocator keeps a page's tokens together, in order).

Formats (D and SGLang's dtypes -> mla_ext's kv_cache_dtype):

* bf16/fp16/fp32 pool of the model dtype, D = L + R: ``auto``;
* ``float8_e4m3fn`` / ``float8_e5m2`` pool, D = L + R: ``fp8_e4m3`` / ``fp8_e5m2``
  with K scale 1.0 (SGLang writes and reads them by a plain cast);
* the DSA (sparse-attention) fp8 pool, D = 656 bytes, 64-token pages:
  ``fp8_ds_mla`` (vLLM's row layout, which SGLang uses);
* the FP4 pool (``MLATokenToKVPoolFP4``: data and scales in separate tensors, not
  nvfp4_ds_mla) and anything else: not served (``Unsupported`` says why).
"""
from __future__ import annotations

import torch


class Unsupported(Exception):
    """This layer/pool stays with SGLang; str() is the reason (logged once)."""


def _mla_pool(pool):
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MLATokenToKVPool

    if isinstance(pool, HybridLinearKVPool):
        pool = pool.full_kv_pool
    if not isinstance(pool, MLATokenToKVPool):
        raise Unsupported(f"{type(pool).__name__} is not an MLA token-to-KV pool")
    return pool


def kv_cache_format(pool, model_dtype: torch.dtype | None, L: int, R: int) -> tuple[str, torch.dtype]:
    """(mla_ext kv_cache_dtype, dtype to view the buffer as) for SGLang's `pool`
    (`model_dtype` None: the pool's own dtype is not checked against the model's)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPoolFP4

    pool = _mla_pool(pool)
    if isinstance(pool, MLATokenToKVPoolFP4):
        raise Unsupported("SGLang's FP4 MLA pool (data and scales in separate tensors) is not an "
                          "mla_ext format")
    dim = pool.kv_cache_dim
    if getattr(pool, "dsa_kv_cache_store_fp8", False):
        if (dim, L, R, pool.page_size) != (656, 512, 64, 64):
            raise Unsupported(f"DSA fp8 pool with {dim}-byte rows, L={L}, R={R}, page {pool.page_size} "
                              "(fp8_ds_mla needs 656, 512, 64, 64)")
        return "fp8_ds_mla", torch.uint8
    if dim != L + R:
        raise Unsupported(f"pool rows of {dim} elements, expected L + R = {L + R}")
    if pool.dtype == torch.float8_e4m3fn:
        return "fp8_e4m3", torch.uint8
    if pool.dtype == torch.float8_e5m2:
        return "fp8_e5m2", torch.uint8
    if model_dtype is not None and pool.dtype != model_dtype:
        raise Unsupported(f"a {pool.dtype} pool for a {model_dtype} model")
    return "auto", pool.dtype


def paged_cache(pool, layer_id: int, view_dtype: torch.dtype) -> torch.Tensor:
    """The layer's buffer as [pages, page_size, D] (a view, no copy)."""
    pool = _mla_pool(pool)
    buf = pool.get_key_buffer(layer_id)  # waits for a layer still in transfer (HiCache)
    ps = pool.page_size
    if buf.dim() != 3 or buf.shape[1] != 1 or buf.shape[0] % ps or not buf.is_contiguous():
        raise Unsupported(f"layer {layer_id}'s buffer {tuple(buf.shape)} is not [k * {ps}, 1, D] contiguous")
    if buf.dtype != view_dtype:
        buf = buf.view(view_dtype)
    return buf.view(-1, ps, buf.shape[-1])


def block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_prefix: int,
                page_size: int) -> torch.Tensor:
    """int32 [num_reqs, ceil(max_prefix / page_size)] page ids of each request's prefix."""
    pages = max(1, -(-max_prefix // page_size))
    rows = req_to_token[req_pool_indices.long(), : pages * page_size : page_size]
    return torch.div(rows, page_size, rounding_mode="floor").to(torch.int32)
