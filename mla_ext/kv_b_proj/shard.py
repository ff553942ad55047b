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

from mla_ext.kv_b_proj.rows import _check_int, shard_rows  # noqa: F401  (shard_rows re-exported)
from mla_ext.kv_b_proj.weights import WeightFormat


def shard_weight(fmt: WeightFormat, num_heads: int, head_rows: int, tp_size: int, rank: int) -> WeightFormat:
    """The kv_b_proj shard of `rank`: heads [rank·n, (rank+1)·n), n = num_heads / tp_size.

    `fmt` is the full (unsharded) weight, N = num_heads · head_rows. Returns a
    format of the same kind with N = n · head_rows (`fmt` itself at tp_size 1)."""
    if not isinstance(fmt, WeightFormat):
        raise ValueError(f"fmt: expected a kv_b_proj WeightFormat (DenseWeight, Fp8Weight, ...), got "
                         f"{type(fmt).__name__}; convert a module first with weight_format_from_module")
    return fmt.shard(num_heads, head_rows, tp_size, rank)


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
