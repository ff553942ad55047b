"""vLLM 0.33's DSA indexer-cache ops over mla_ext.sparse.index_cache (same names, argument order and
in-place outputs; torch ops in the ``mla_ext_vllm`` namespace with fake kernels). Re-exported by
``mla_ext.vllm._custom_ops``.

indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype)
    Writes k [T, D] into the fp8 index cache [num_blocks, B, D + 4*D/Q] in vLLM's page layout.
    vLLM passes its scale format in the last argument: "ue8m0" rounds each scale up to a power
    of two; "" / "fp8" / "fp8_e4m3" / "auto" / "fp32" keep amax/448. Slot -1 is skipped.
cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    The raw e4m3 bytes dst_k uint8 [T, D] and the scales as bytes dst_scale uint8 [T, 4*D/Q] of
    tokens 0.. of every request (rows cu_seq_lens[r] ..).

The DSA indexer's top-k over its logits (vLLM _C's names and arguments; mla_ext.sparse.topk_per_row):

top_k_per_row_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, raw_topk_indices, num_rows, stride0, stride1,
                      topk_tokens)
    Row m of logits [>= num_rows, W] fp32 selects the topk_tokens largest columns of
    [cu_seqlen_ks[m], cu_seqlen_ke[m]) and writes them, relative to cu_seqlen_ks[m], into
    raw_topk_indices[m, :topk_tokens] (int32, written in place through its strides), -1 padded.
top_k_per_row_decode(logits, next_n, seq_lens, raw_topk_indices, num_rows, stride0, stride1, topk_tokens)
    As prefill with row starts 0 and row ends from seq_lens: [B, next_n] per row, [B, 1] / [B] per
    request (row j of its next_n sees L - next_n + j + 1 columns).
persistent_topk(logits, lengths, output, workspace, k, max_seq_len)
    vLLM's decode top-k for topk 512/1024/2048 (vllm/model_executor/layers/indexer_topk.py calls
    torch.ops._C.persistent_topk): row r selects among columns [0, lengths.view(-1)[r]); the
    workspace and max_seq_len (vLLM's launch tuning) are not needed here and are not touched.
vLLM's kernels state no order among the selected indices nor which of tied scores is chosen; these
order by score with the library's tie rule (higher score, then lower column).
"""
from torch import Tensor
import torch

from mla_ext.sparse import index_cache as ic
from mla_ext.sparse.topk_per_row import decode_row_ends, top_k_per_row

NAMESPACE = "mla_ext_vllm"
PLAIN_SCALES = ("", "fp8", "fp8_e4m3", "auto", "fp32")


def _check(cond, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_write(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype) -> None:
    _check(k.dim() == 2, f"k: expected [num_tokens, head_dim], got {tuple(k.shape)}")
    _check(kv_cache.dim() == 3 and kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn),
           f"kv_cache: expected a 3-D uint8 (or float8_e4m3fn) index cache, got {kv_cache.dtype} "
           f"{tuple(kv_cache.shape)}")
    _check(isinstance(quant_block_size, int) and quant_block_size > 0 and k.shape[1] % quant_block_size == 0,
           f"quant_block_size: expected a positive divisor of head_dim={k.shape[1]}, got {quant_block_size!r}")
    _check(kv_cache.shape[2] == k.shape[1] + 4 * (k.shape[1] // quant_block_size),
           f"kv_cache: expected rows of {k.shape[1] + 4 * (k.shape[1] // quant_block_size)} bytes "
           f"(head_dim + 4 * head_dim / quant_block_size), got {kv_cache.shape[2]}")
    _check(kv_cache_dtype == "ue8m0" or kv_cache_dtype in PLAIN_SCALES,
           f"kv_cache_dtype: expected 'ue8m0' or one of {PLAIN_SCALES} (the scale format), got {kv_cache_dtype!r}")
    _check(slot_mapping.dim() == 1 and slot_mapping.shape[0] <= k.shape[0],
           f"slot_mapping: expected 1-D with at most {k.shape[0]} entries, got {tuple(slot_mapping.shape)}")
    _check(k.device == kv_cache.device == slot_mapping.device,
           f"k / kv_cache / slot_mapping: expected one device, got {k.device}, {kv_cache.device}, "
           f"{slot_mapping.device}")


@torch.library.custom_op(f"{NAMESPACE}::indexer_k_quant_and_cache", mutates_args=("kv_cache",))
def indexer_k_quant_and_cache(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, quant_block_size: int,
                              kv_cache_dtype: str) -> None:
    _check_write(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype)
    n = slot_mapping.shape[0]  # vLLM: k may be padded past the slots
    ic.write_index_cache(k[:n], kv_cache.view(torch.uint8), slot_mapping, "fp8", quant_block_size=quant_block_size,
                         scale_fmt="ue8m0" if kv_cache_dtype == "ue8m0" else None)


@indexer_k_quant_and_cache.register_fake
def _(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype):
    _check_write(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype)


def _check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
    _check(kv_cache.dim() == 3 and kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn),
           f"kv_cache: expected a 3-D uint8 (or float8_e4m3fn) index cache, got {kv_cache.dtype}")
    _check(dst_k.dim() == 2 and dst_k.element_size() == 1,
           f"dst_k: expected a 1-byte [num_tokens, head_dim] tensor, got {dst_k.dtype} {tuple(dst_k.shape)}")
    S = (kv_cache.shape[2] - dst_k.shape[1]) // 4
    _check(S >= 1 and kv_cache.shape[2] == dst_k.shape[1] + 4 * S,
           f"dst_k: head_dim {dst_k.shape[1]} does not fit the cache's {kv_cache.shape[2]}-byte rows")
    _check(dst_scale.dim() == 2 and dst_scale.shape[0] == dst_k.shape[0]
           and dst_scale.shape[1] * dst_scale.element_size() == 4 * S,
           f"dst_scale: expected [{dst_k.shape[0]}, {4 * S}] bytes (or [{dst_k.shape[0]}, {S}] fp32), got "
           f"{dst_scale.dtype} {tuple(dst_scale.shape)}")
    _check(block_table.dim() == 2 and block_table.dtype == torch.int32,
           f"block_table: expected int32 [num_reqs, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    _check(cu_seq_lens.dim() == 1 and cu_seq_lens.dtype == torch.int32,
           f"cu_seq_lens: expected int32 [num_reqs + 1], got {cu_seq_lens.dtype} {tuple(cu_seq_lens.shape)}")


@torch.library.custom_op(f"{NAMESPACE}::cp_gather_indexer_k_quant_cache", mutates_args=("dst_k", "dst_scale"))
def cp_gather_indexer_k_quant_cache(kv_cache: Tensor, dst_k: Tensor, dst_scale: Tensor, block_table: Tensor,
                                    cu_seq_lens: Tensor) -> None:
    _check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    ic.cp_gather_indexer_k_quant_cache(kv_cache.view(torch.uint8), dst_k.view(torch.uint8),
                                       dst_scale.view(torch.uint8), block_table, cu_seq_lens)


@cp_gather_indexer_k_quant_cache.register_fake
def _(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    _check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)


def _check_topk(logits, out, num_rows, stride0, stride1, topk_tokens, row_args) -> None:
    _check(logits.dim() == 2 and logits.dtype == torch.float32,
           f"logits: expected a 2-D float32 tensor, got {logits.dtype} {tuple(logits.shape)}")
    _check(isinstance(num_rows, int) and 0 <= num_rows <= logits.shape[0],
           f"num_rows: expected an int in [0, {logits.shape[0]}] (logits' rows), got {num_rows!r}")
    _check((stride0, stride1) == tuple(logits.stride()) or num_rows == 0,
           f"stride0 / stride1: expected logits' strides {tuple(logits.stride())}, got ({stride0}, {stride1})")
    _check(isinstance(topk_tokens, int) and topk_tokens > 0,
           f"topk_tokens: expected a positive int, got {topk_tokens!r}")
    _check(out.dim() == 2 and out.dtype == torch.int32 and out.shape[0] >= num_rows and out.shape[1] >= topk_tokens,
           f"raw_topk_indices: expected int32 [>= {num_rows}, >= {topk_tokens}], got {out.dtype} "
           f"{tuple(out.shape)}")
    for name, t in row_args:
        _check(t.dtype in (torch.int32, torch.int64), f"{name}: expected an int32 tensor, got {t.dtype}")
        _check(t.device == logits.device, f"{name}: on {t.device}, expected logits' device {logits.device}")
    _check(out.device == logits.device, f"raw_topk_indices: on {out.device}, expected logits' device {logits.device}")


@torch.library.custom_op(f"{NAMESPACE}::top_k_per_row_prefill", mutates_args=("raw_topk_indices",))
def _top_k_per_row_prefill_op(logits: Tensor, cu_seqlen_ks: Tensor, cu_seqlen_ke: Tensor, raw_topk_indices: Tensor,
                          num_rows: int, stride0: int, stride1: int, topk_tokens: int) -> None:
    _check_topk(logits, raw_topk_indices, num_rows, stride0, stride1, topk_tokens,
                (("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)))
    _check(cu_seqlen_ks.numel() >= num_rows and cu_seqlen_ke.numel() >= num_rows,
           f"cu_seqlen_ks / cu_seqlen_ke: expected >= {num_rows} entries, got {cu_seqlen_ks.numel()} / "
           f"{cu_seqlen_ke.numel()}")
    top_k_per_row(logits[:num_rows], cu_seqlen_ks.reshape(-1)[:num_rows], cu_seqlen_ke.reshape(-1)[:num_rows],
                  raw_topk_indices[:num_rows, :topk_tokens])


@_top_k_per_row_prefill_op.register_fake
def _(logits, cu_seqlen_ks, cu_seqlen_ke, raw_topk_indices, num_rows, stride0, stride1, topk_tokens):
    _check_topk(logits, raw_topk_indices, num_rows, stride0, stride1, topk_tokens,
                (("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)))


@torch.library.custom_op(f"{NAMESPACE}::top_k_per_row_decode", mutates_args=("raw_topk_indices",))
def _top_k_per_row_decode_op(logits: Tensor, next_n: int, seq_lens: Tensor, raw_topk_indices: Tensor, num_rows: int,
                         stride0: int, stride1: int, topk_tokens: int) -> None:
    _check_topk(logits, raw_topk_indices, num_rows, stride0, stride1, topk_tokens, (("seq_lens", seq_lens),))
    _check(isinstance(next_n, int) and next_n >= 1, f"next_n: expected a positive int, got {next_n!r}")
    top_k_per_row(logits[:num_rows], None, decode_row_ends(seq_lens, next_n, num_rows),
                  raw_topk_indices[:num_rows, :topk_tokens])


@_top_k_per_row_decode_op.register_fake
def _(logits, next_n, seq_lens, raw_topk_indices, num_rows, stride0, stride1, topk_tokens):
    _check_topk(logits, raw_topk_indices, num_rows, stride0, stride1, topk_tokens, (("seq_lens", seq_lens),))


def _check_persistent(logits, lengths, output, k) -> None:
    _check(logits.dim() == 2, f"logits: expected [rows, columns], got {tuple(logits.shape)}")
    _check_topk(logits, output, logits.shape[0] if logits.dim() == 2 else 0, *logits.stride()[:2], k,
                (("lengths", lengths),))
    _check(lengths.dim() in (1, 2) and lengths.numel() == logits.shape[0],
           f"lengths: expected one entry per logits row ({logits.shape[0]}), [rows] or [B, next_n], got "
           f"{tuple(lengths.shape)}")


@torch.library.custom_op(f"{NAMESPACE}::persistent_topk", mutates_args=("output", "workspace"))
def _persistent_topk_op(logits: Tensor, lengths: Tensor, output: Tensor, workspace: Tensor, k: int,
                    max_seq_len: int) -> None:
    _check_persistent(logits, lengths, output, k)
    top_k_per_row(logits, None, decode_row_ends(lengths, 1, logits.shape[0]), output[:, :k])


@_persistent_topk_op.register_fake
def _(logits, lengths, output, workspace, k, max_seq_len):
    _check_persistent(logits, lengths, output, k)


# vLLM's routes bind these plain functions (named as vLLM's, so a routed name reads as mla_ext's);
# each runs its torch op (the custom ops above, opaque to torch.compile with their fake kernels).
def top_k_per_row_prefill(logits: Tensor, cu_seqlen_ks: Tensor, cu_seqlen_ke: Tensor, raw_topk_indices: Tensor,
                          num_rows: int, stride0: int, stride1: int, topk_tokens: int) -> None:
    _top_k_per_row_prefill_op(logits, cu_seqlen_ks, cu_seqlen_ke, raw_topk_indices, num_rows, stride0, stride1,
                              topk_tokens)


def top_k_per_row_decode(logits: Tensor, next_n: int, seq_lens: Tensor, raw_topk_indices: Tensor, num_rows: int,
                         stride0: int, stride1: int, topk_tokens: int) -> None:
    _top_k_per_row_decode_op(logits, next_n, seq_lens, raw_topk_indices, num_rows, stride0, stride1, topk_tokens)


def persistent_topk(logits: Tensor, lengths: Tensor, output: Tensor, workspace: Tensor, k: int,
                    max_seq_len: int) -> None:
    _persistent_topk_op(logits, lengths, output, workspace, k, max_seq_len)


OPS = (indexer_k_quant_and_cache, cp_gather_indexer_k_quant_cache, _top_k_per_row_prefill_op,
       _top_k_per_row_decode_op, _persistent_topk_op)
