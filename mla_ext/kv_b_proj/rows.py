"""Row arithmetic of kv_b_proj shared by every weight format: which output rows a
tensor-parallel rank holds (heads are split evenly) and whether a row cut respects a
format's blocks (block fp8's 128 rows, Marlin's 64-row packing tiles)."""
from __future__ import annotations


def check_row_cut(start: int, stop: int, n: int, unit: int, what: str, advice: str = "") -> None:
    """ValueError unless rows [start, stop) of an n-row weight start and end on
    a multiple of `unit` rows (or at n): `what` names the unit, e.g. "128-row
    quantization block"."""
    for edge in (start, stop):
        if edge % unit and edge != n:
            i = edge // unit
            raise ValueError(f"rows [{start}, {stop}) split the {what} {i} "
                             f"(rows [{i * unit}, {min(i * unit + unit, n)})) "
                             f"at row {edge}; slices must start and end on a multiple of {unit} rows (or at N={n})"
                             + (f": {advice}" if advice else ""))


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
