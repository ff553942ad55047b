"""The DSA indexer's key cache, one per layer: formats, page size, writer and gathers (CPU torch).

Each token of a layer caches one indexer key k_I [D] (D = index_head_dim, 128 in the
published configs) beside its latent row. Two formats (mirror of
csrc/common/indexer_cache_layout.h, which the compiled kernels use; tests/test_sparse_index_cache_cpp.py
compares both through the compiled op index_cache_format_info):

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

The page size (`page_bytes`, `IndexCacheSpec`) is what the planner adds beside the latent page.
The writer and the gathers dispatch (index_cache_backends.py) to the compiled CUDA kernels, Triton
(triton_index_cache.py), the compiled CPU kernels (csrc/sparse/), then torch (the reference here);
on the CPU the wrappers check slots, block ids and the offsets first (ValueError naming the
argument: cu_seq_lens negative, decreasing or past the output, seq_starts negative, an output
too short; `check_gather_offsets`, the latent gathers' checker). On CUDA nothing is read on the
host (no sync): the kernels bound every row instead (rows outside cu_seq_lens untouched, a token
outside the table or the cache gives a zero row).
Gathers follow the latent gather's conventions (SPEC §6): block_table int32
[num_reqs, max_blocks], cu_seq_lens int32 [num_reqs+1] output row offsets, optional
seq_starts int32 [num_reqs].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext._args import check_no_meta
from mla_ext.cache.checks import check_block_ids

E4M3_MAX = 448.0
MIN_SCALE = 1e-4


@dataclass(frozen=True)
class IndexCacheFormat:
    name: str
    quantized: bool
    native_dtype: torch.dtype = torch.bfloat16

    def bytes_per_token(self, head_dim: int, quant_block_size: int | None = None) -> int:
        _check_dims(head_dim, quant_block_size if self.quantized else None)
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


def _check_dims(head_dim, quant_block_size) -> None:
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 4:
        raise ValueError(f"head_dim: expected a positive multiple of 4, got {head_dim!r}")
    if quant_block_size is not None and (not isinstance(quant_block_size, int) or quant_block_size <= 0
                                         or head_dim % quant_block_size):
        raise ValueError(f"quant_block_size: expected a positive divisor of head_dim={head_dim}, "
                         f"got {quant_block_size!r}")


def _geometry(cache: Tensor, fmt: IndexCacheFormat, head_dim: int | None) -> tuple[int, int, int]:
    """(block_size, head_dim, scales per token) of a cache tensor, checked."""
    if cache.dim() != 3 or cache.dtype != fmt.storage_dtype:
        raise ValueError(f"index cache: expected a 3-D {fmt.storage_dtype} tensor for format {fmt.name!r}, got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    B, width = cache.shape[1], cache.shape[2]
    if not fmt.quantized:
        return B, width, 0
    if head_dim is None:
        raise ValueError("head_dim: required for the fp8 index cache (the row width holds the scales too)")
    if (width - head_dim) % 4 or width <= head_dim or head_dim % ((width - head_dim) // 4):
        raise ValueError(f"index cache: width {width} is not head_dim={head_dim} + 4 * head_dim / Q")
    if not cache[0].is_contiguous():
        raise ValueError("index cache: fp8 pages must be contiguous (values then scales)")
    return B, head_dim, (width - head_dim) // 4


def check_index_cache(cache, index_cache_dtype, head_dim: int, block_size: int | None = None,
                      arg: str = "index_cache") -> None:
    """An index cache for `index_cache_dtype` and index_head_dim `head_dim`, checked up front (no
    data read): a 3-D tensor of the format's storage dtype holding data (not meta), rows of
    head_dim values (fp8: head_dim + 4 * head_dim / Q bytes) and, when given, `block_size` tokens
    per page (the latent cache's: one block table names both pages)."""
    fmt = get_index_format(index_cache_dtype)
    if not isinstance(cache, Tensor):
        raise ValueError(f"{arg}: expected a torch.Tensor, got {type(cache).__name__}")
    check_no_meta(**{arg: cache})
    try:
        B, D, _ = _geometry(cache, fmt, head_dim)
    except ValueError as exc:
        raise ValueError(f"{arg}: {exc}") from None
    if D != head_dim:
        raise ValueError(f"{arg}: expected rows of index_head_dim={head_dim} values ({fmt.name}), got width "
                         f"{cache.shape[2]}")
    if block_size is not None and B != block_size:
        raise ValueError(f"{arg}: expected block_size {block_size} (the latent cache's: one block table names both "
                         f"pages), got {B}")


def quantize_fp8_rows(k: Tensor, quant_block_size: int, scale_fmt: str | None = None) -> tuple[Tensor, Tensor]:
    """k [T, D] -> (e4m3 values as uint8 [T, D], fp32 scales [T, D/Q]) as the fp8 index cache stores them."""
    T, D = k.shape
    x = k.to(torch.float32).view(T, D // quant_block_size, quant_block_size)
    scale = x.abs().amax(dim=-1).clamp_min(MIN_SCALE) / E4M3_MAX
    if scale_fmt == "ue8m0":  # up to a power of two, exactly on the bits: torch.log2 rounds 2^k * (1 + 2^-23)
        bits = scale.view(torch.int32)  # down to k (the Triton and compiled writers do the same)
        up = ((bits & 0x7FFFFF) != 0) & ((bits & 0x7F800000) != 0x7F800000)
        scale = torch.where(up, (bits & 0x7F800000) + 0x800000, bits).view(torch.float32)
    elif scale_fmt not in (None, "", "fp32"):
        raise ValueError(f"scale_fmt: expected None, 'fp32' or 'ue8m0', got {scale_fmt!r}")
    q = (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(T, D).view(torch.uint8), scale


def dequantize_fp8_rows(values: Tensor, scales: Tensor) -> Tensor:
    """(uint8 [T, D], fp32 [T, D/Q]) -> float32 [T, D]."""
    T, D = values.shape
    x = values.view(torch.float8_e4m3fn).to(torch.float32).view(T, scales.shape[1], -1)
    return (x * scales[..., None]).view(T, D)


def _page_parts(cache: Tensor, D: int, S: int) -> tuple[Tensor, Tensor]:
    """fp8 cache -> (values [nb, B, D] uint8, scales [nb, B, S] fp32) views of its pages."""
    nb, B = cache.shape[0], cache.shape[1]
    flat = cache.as_strided((nb, B * cache.shape[2]), (cache.stride(0), 1))  # pages may be strided apart
    vals = flat[:, : B * D].view(nb, B, D)
    scales = flat[:, B * D: B * D + 4 * B * S].view(torch.float32).view(nb, B, S)
    return vals, scales


def write_index_cache(k: Tensor, cache: Tensor, slot_mapping: Tensor, index_cache_dtype="bfloat16", *,
                      quant_block_size: int | None = None, scale_fmt: str | None = None) -> None:
    """Store k [T, D] at slots (block * B + offset; a negative slot is skipped, as vLLM's).
    Runs the first usable backend of index_cache_backends.INDEX_WRITE (CUDA, Triton, C++ CPU, torch)."""
    from mla_ext.sparse.index_cache_backends import INDEX_WRITE, IndexWriteInputs

    fmt = get_index_format(index_cache_dtype)
    check_no_meta(k=k, cache=cache, slot_mapping=slot_mapping)
    if k.dim() != 2:
        raise ValueError(f"k: expected [T, D], got {tuple(k.shape)}")
    T, D = k.shape
    B, Dc, S = _geometry(cache, fmt, D)
    if Dc != D:
        raise ValueError(f"k: expected head_dim {Dc} (the cache's), got {D}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != T or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: expected int32/int64 [{T}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    Q = None
    if fmt.quantized:
        Q = quant_block_size or D // S
        if Q * S != D:
            raise ValueError(f"quant_block_size: expected {D // S} for this cache, got {quant_block_size}")
        if scale_fmt not in (None, "", "fp32", "ue8m0"):
            raise ValueError(f"scale_fmt: expected None, 'fp32' or 'ue8m0', got {scale_fmt!r}")
    if slot_mapping.device.type == "cpu":  # host check where it costs no sync; CUDA kernels skip such slots
        if bool((slot_mapping >= cache.shape[0] * B).any()):
            raise ValueError(f"slot_mapping: slots must be < num_blocks * block_size = {cache.shape[0] * B}")
    if T:
        INDEX_WRITE(IndexWriteInputs(k, cache, slot_mapping, fmt, Q, scale_fmt))


def _write_torch(inp) -> None:
    """The torch writer (reference of the compiled and Triton ones): out-of-range slots skipped."""
    k, cache, fmt = inp.k, inp.cache, inp.fmt
    B = cache.shape[1]
    slots = inp.slot_mapping.to(torch.int64).cpu()
    keep = (slots >= 0) & (slots < cache.shape[0] * B)
    blk, off = (slots[keep] // B).to(cache.device), (slots[keep] % B).to(cache.device)
    rows = k[keep.to(k.device)]
    if not fmt.quantized:
        cache[blk, off] = rows.to(fmt.native_dtype)
        return
    D = k.shape[1]
    vals, scales = _page_parts(cache, D, D // inp.quant_block_size)
    qv, sc = quantize_fp8_rows(rows, inp.quant_block_size, inp.scale_fmt)
    vals[blk, off] = qv
    scales[blk, off] = sc


def indexer_k_quant_and_cache(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, quant_block_size: int,
                              scale_fmt: str | None) -> None:
    """vLLM's op name and arguments: fp8 index cache writer."""
    write_index_cache(k, kv_cache, slot_mapping, "fp8", quant_block_size=quant_block_size, scale_fmt=scale_fmt)


def _token_slots(block_table: Tensor, cu_seq_lens: Tensor, seq_starts: Tensor | None, B: int,
                 num_blocks: int) -> tuple[Tensor, Tensor]:
    """(block ids, offsets) int64 for every output row, checked against the table and the cache."""
    cu = cu_seq_lens.to(torch.int64).cpu()
    n = len(cu) - 1
    if block_table.dim() != 2 or block_table.shape[0] < n:
        raise ValueError(f"block_table: expected [>= {n}, max_blocks], got {tuple(block_table.shape)}")
    lens = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(n), lens)
    tok = torch.arange(int(cu[-1])) - cu[:-1][req]
    if seq_starts is not None:
        tok = tok + seq_starts.to(torch.int64).cpu()[req]
    lblk = tok // B
    if bool((lblk >= block_table.shape[1]).any()):
        raise ValueError(f"block_table: a token's logical block is past the table width {block_table.shape[1]}")
    blk = block_table.to(torch.int64).cpu()[req, lblk]
    if bool(((blk < 0) | (blk >= num_blocks)).any()):
        raise ValueError(f"block_table: block ids must be in [0, {num_blocks})")
    return blk, tok % B


def check_gather_offsets(cache: Tensor, block_table: Tensor, cu_seq_lens: Tensor, seq_starts: Tensor | None,
                         B: int, dst_rows: int | None = None, dst_arg: str = "out") -> int:
    """The host checks of a gather on CPU tensors (mla_ext.cache.checks.check_block_ids, the latent
    gathers' checker): cu_seq_lens non-negative and non-decreasing, no request past `dst_rows`,
    seq_starts >= 0, every block a request reads inside the table and the cache. Returns the rows.
    CUDA tensors are not read (that would sync): the kernels give zero rows for anything out of range."""
    if cu_seq_lens.dim() != 1 or cu_seq_lens.numel() < 1:
        raise ValueError(f"cu_seq_lens: expected [num_reqs + 1] offsets, got shape {tuple(cu_seq_lens.shape)}")
    n = cu_seq_lens.numel() - 1
    if seq_starts is not None and (seq_starts.dim() != 1 or seq_starts.numel() < n):
        raise ValueError(f"seq_starts: expected [>= {n}] (one per request), got shape {tuple(seq_starts.shape)}")
    return check_block_ids(block_table, cu_seq_lens, n, seq_starts, cache.shape[0], B, dst_rows, dst_arg=dst_arg)


def gather_index_keys(cache: Tensor, block_table: Tensor, cu_seq_lens: Tensor, index_cache_dtype="bfloat16", *,
                      seq_starts: Tensor | None = None, head_dim: int | None = None,
                      out: Tensor | None = None) -> Tensor:
    """Dequantized keys float32 [cu_seq_lens[-1], D]: row cu_seq_lens[r] + i = token seq_starts[r] + i of r.
    Runs the first usable backend of index_cache_backends.INDEX_GATHER; on CUDA out-of-range block ids
    read zero rows (no host check), on the CPU they raise ValueError."""
    from mla_ext.sparse.index_cache_backends import INDEX_GATHER, IndexGatherInputs

    fmt = get_index_format(index_cache_dtype)
    check_no_meta(cache=cache, block_table=block_table, cu_seq_lens=cu_seq_lens, seq_starts=seq_starts, out=out)
    B, D, S = _geometry(cache, fmt, head_dim)
    if out is not None and (out.dim() != 2 or out.shape[1] != D):
        raise ValueError(f"out: expected [rows, {D}], got {tuple(out.shape)}")
    if cache.device.type == "cpu":  # raises when out of range
        rows = check_gather_offsets(cache, block_table, cu_seq_lens, seq_starts, B,
                                    None if out is None else out.shape[0])
        if out is not None and out.shape[0] != rows:
            raise ValueError(f"out: expected {rows} rows (cu_seq_lens[-1]), got {out.shape[0]}")
    if out is None:
        out = torch.empty(int(cu_seq_lens[-1]), D, dtype=torch.float32, device=cache.device)
    INDEX_GATHER(IndexGatherInputs(cache, block_table, cu_seq_lens, fmt, seq_starts, D, out))
    return out


def _gather_torch(inp) -> None:
    """The torch gather (reference of the compiled and Triton ones): float32 rows, or raw bytes + scales."""
    B, D, S = _geometry(inp.cache, inp.fmt, inp.head_dim)
    blk, off = _token_slots(inp.block_table, inp.cu_seq_lens, inp.seq_starts, B, inp.cache.shape[0])
    blk, off = blk.to(inp.cache.device), off.to(inp.cache.device)
    if inp.dst_scale is not None:
        vals, scales = _page_parts(inp.cache, D, S)
        inp.out.copy_(vals[blk, off].view(inp.out.dtype))
        inp.dst_scale.copy_(scales[blk, off].contiguous().view(torch.uint8).view(inp.dst_scale.dtype)
                            .view(inp.dst_scale.shape))
        return
    if inp.fmt.quantized:
        vals, scales = _page_parts(inp.cache, D, S)
        rows = dequantize_fp8_rows(vals[blk, off], scales[blk, off])
    else:
        rows = inp.cache[blk, off].to(torch.float32)
    inp.out.copy_(rows)


def cp_gather_indexer_k_quant_cache(kv_cache: Tensor, dst_k: Tensor, dst_scale: Tensor, block_table: Tensor,
                                    cu_seq_lens: Tensor) -> None:
    """vLLM's op name and arguments: raw e4m3 bytes dst_k uint8 [T, D] and their scales as bytes
    dst_scale uint8 [T, 4*D/Q] of the fp8 index cache, tokens 0.. of each request."""
    from mla_ext.sparse.index_cache_backends import INDEX_GATHER, IndexGatherInputs

    check_no_meta(kv_cache=kv_cache, dst_k=dst_k, dst_scale=dst_scale, block_table=block_table,
                  cu_seq_lens=cu_seq_lens)
    if dst_k.dim() != 2 or dst_scale.dim() != 2 or dst_scale.shape[0] != dst_k.shape[0]:
        raise ValueError(f"dst_k / dst_scale: expected [T, D] / [T, 4*D/Q] with one T, got {tuple(dst_k.shape)} / "
                         f"{tuple(dst_scale.shape)}")
    B, D, S = _geometry(kv_cache, FORMATS["fp8"], dst_k.shape[1])
    if kv_cache.device.type == "cpu":  # raises when out of range, or when dst_k is too short
        check_gather_offsets(kv_cache, block_table, cu_seq_lens, None, B, dst_k.shape[0], "dst_k")
    INDEX_GATHER(IndexGatherInputs(kv_cache, block_table, cu_seq_lens, FORMATS["fp8"], None, D, dst_k, dst_scale))


@dataclass(frozen=True)
class IndexCacheSpec:
    """One layer's index cache for the pool planner (mla_ext.planner.plan_pool(index_specs=)):
    its pages sit beside the latent pages, same block ids, same block size."""
    layer_index: int
    index_cache_dtype: str
    head_dim: int
    block_size: int
    quant_block_size: int | None = None

    def __post_init__(self):
        get_index_format(self.index_cache_dtype)
        _check_dims(self.head_dim, self.quant_block_size if self.format.quantized else None)
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
