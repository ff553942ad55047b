"""Tensor-parallel shards of kv_b_proj, for every weight format (SPEC §10).

kv_b_proj is column-parallel over heads: the full weight is [H·(P+V), L] with
head h owning output rows [h·(P+V), (h+1)·(P+V)) (first P k_nope, last V v).
With `tp_size` ranks each rank holds H / tp_size consecutive heads; rank r
holds heads [r·n, (r+1)·n), i.e. rows [r·n·(P+V), (r+1)·n·(P+V)).

How each format is cut (`WeightFormat.slice_rows`):
- dense, NVFP4 (block scales run along K), fp8 per-channel: rows and their
  per-row scales; fp8 per-tensor and the NVFP4 global scale are kept whole;
- int4 groups (qweight int32 [K/8, N] packs along K, groups run along K):
  output rows are columns of qweight/scales/zeros, so any cut is clean;
- block fp8 (128×128): the cut must fall on a 128-row block boundary (else a
  ValueError naming the block), e.g. P+V=256 always aligns, P+V=448 (P=192,
  V=256) needs an even head count per rank;
- Marlin-packed fp8: the cut must fall on a 64-row packing tile (P+V=256 and
  448 both do); otherwise shard the checkpoint fp8 format and pack the shard:
  `MarlinFp8Weight.from_fp8(shard_weight(fp8_format, ...))`.
Each shard owns copies of its tensors, so the full weight can be freed.
"""
from __future__ import annotations

from mla_ext.kv_b_proj.weights import WeightFormat


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def shard_rows(num_heads: int, head_rows: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Output rows [start, stop) of the full kv_b_proj that `rank` holds.

    num_heads: the FULL model's attention heads (num_attention_heads);
    head_rows: P + V (qk_nope_head_dim + v_head_dim)."""
    _check_int("num_heads", num_heads, 1)
    _check_int("head_rows", head_rows, 1)
    _check_int("tp_size", tp_size, 1)
    _check_int("rank", rank, 0)
    if num_heads % tp_size:
        raise ValueError(f"tp_size: expected a divisor of num_heads={num_heads} (heads are split evenly "
                         f"across ranks), got {tp_size}")
    if rank >= tp_size:
        raise ValueError(f"rank: expected 0 <= rank < tp_size={tp_size}, got {rank}")
    per_rank = num_heads // tp_size
    return rank * per_rank * head_rows, (rank + 1) * per_rank * head_rows


def shard_weight(fmt: WeightFormat, num_heads: int, head_rows: int, tp_size: int, rank: int) -> WeightFormat:
    """The kv_b_proj shard of `rank`: heads [rank·n, (rank+1)·n), n = num_heads / tp_size.

    `fmt` is the full (unsharded) weight, N = num_heads · head_rows. Returns a
    format of the same kind with N = n · head_rows (`fmt` itself at tp_size 1)."""
    if not isinstance(fmt, WeightFormat):
        raise ValueError(f"fmt: expected a kv_b_proj WeightFormat (DenseWeight, Fp8Weight, ...), got "
                         f"{type(fmt).__name__}; convert a module first with weight_format_from_module")
    start, stop = shard_rows(num_heads, head_rows, tp_size, rank)
    if fmt.N != num_heads * head_rows:
        raise ValueError(f"fmt: expected the full kv_b_proj, N = num_heads * head_rows = {num_heads} * {head_rows} "
                         f"= {num_heads * head_rows} rows, got N={fmt.N} ({fmt.describe()})")
    if tp_size == 1:
        return fmt
    try:
        return fmt.slice_rows(start, stop)
    except ValueError as exc:
        per_rank = num_heads // tp_size
        raise ValueError(
            f"cannot shard {fmt.describe()} for tp_size={tp_size}, rank={rank} (heads "
            f"[{rank * per_rank}, {(rank + 1) * per_rank}) of {num_heads}, rows [{start}, {stop})): {exc}") from exc


def shard_for(fmt: WeightFormat, model_config, tp_size: int | None = None,
              rank: int | None = None) -> WeightFormat:
    """`shard_weight` with the head count and P + V read from a model config.

    Either a per-rank config from `MLAModelConfig.shard(tp_size, rank)` (tp_size and
    rank then come from it; if given they must agree), or a full-model config
    (`num_heads` = num_attention_heads) with tp_size and rank given here."""
    for attr in ("num_heads", "P", "V"):
        _check_int(f"model_config.{attr}", getattr(model_config, attr, None), 1)
    cfg_tp, cfg_rank = getattr(model_config, "tp_size", 1), getattr(model_config, "tp_rank", 0)
    if cfg_tp != 1:  # a per-rank config knows its place
        for arg, given, own in (("tp_size", tp_size, cfg_tp), ("rank", rank, cfg_rank)):
            if given is not None and given != own:
                raise ValueError(f"{arg}: model_config is rank {cfg_rank} of {cfg_tp}; "
                                 f"expected {own} or None, got {given!r}")
        tp_size, rank = cfg_tp, cfg_rank
        heads = model_config.num_heads * cfg_tp
    else:
        if tp_size is None or rank is None:
            raise ValueError("tp_size, rank: required with a full-model config (or pass the "
                             "per-rank config from MLAModelConfig.shard)")
        heads = model_config.num_heads
    head_rows = model_config.P + model_config.V
    if isinstance(fmt, WeightFormat) and fmt.N != heads * head_rows:
        raise ValueError(f"fmt: expected the full model's kv_b_proj, [{heads} * {head_rows} = "
                         f"{heads * head_rows}, L] (num_heads * (P + V)); got N = {fmt.N}")
    return shard_weight(fmt, heads, head_rows, tp_size, rank)
