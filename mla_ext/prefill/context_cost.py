"""Which way to attend a context chunk: up-projection or latent space (absorbed).

Per chunk, with C_r context rows and T_r query rows of request r (C = sum C_r,
T = sum T_r), N heads and the layer's dims, both paths are priced as FLOPs and
bytes, and each step takes max(flops / rate, bytes / bandwidth) + one launch:

  up_project  gather      bytes  C * (entry + (L+R) * a)          (cache rows read, workspace written)
              kv_b_proj   flops  2 * C * L * N(P+V)
                          bytes  C*L*a + N(P+V)*L*a + C*N(P+V)*a
              attention   flops  sum_r 2 * C_r * T_r * N * (P+R+V)
                          bytes  C * (N(P+V) + R) * a + T * N * (P+R+V) * a
  absorbed    absorb      flops  2 * T * N * P * L                (q_nope through W_UK)
                          bytes  T*N*P*a + N*P*L*a + T*N*L*a
              latent attn flops  sum_r 2 * C_r * T_r * N * (2L + R)
                          bytes  C * entry + T * N * (L+R) * a + T * N * L * a
              un-absorb   flops  2 * T * N * L * V                (latent output through W_UV)
                          bytes  T*N*L*a + N*L*V*a + T*N*V*a
              (+ the gather's bytes when the rows are gathered first: the CPU path,
               context parallelism)

a = bytes per element of the compute dtype, entry = the cache's bytes per
token. Every (context row, query) pair costs the up-projection path
2N(P+R+V) FLOPs, the absorbed path 2N(2L+R); every context row costs the
up-projection 2N·L(P+V) FLOPs once. So for one request with T new tokens the
absorbed path wins below about T* = L(P+V) / (2L - P - V) (all FLOPs at one
rate): 170.7 for L=512, P=V=128. Keys and values are counted once per chunk
(a request's query tiles run together and share the L2 cache).

Rates: a measured table for the device when the benchmark has written one
(benchmarks/bench_absorbed.py -> the "context_attention" section of
mla_ext/dispatch_tables/<device>.json, key "rates", with optional measured
latent rates per cache format), else the stated defaults
below. The stated CUDA default prices every FLOP alike (the crossover above);
a measurement replaces that with each kernel's own rate.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from mla_ext import dispatch as D

OP = "context_attention"
PATHS = ("absorbed", "up_project")
RATE_KEYS = ("gemm_flops", "attention_flops", "latent_flops", "bytes_per_s", "launch_s")


@dataclass(frozen=True)
class Rates:
    """Effective device rates the cost model prices steps with."""

    gemm_flops: float  # FLOP/s of the 16-bit GEMMs (kv_b_proj, absorb, un-absorb)
    attention_flops: float  # FLOP/s of head-space varlen attention
    latent_flops: float  # FLOP/s of the latent-space attention kernel (decode included)
    bytes_per_s: float  # device memory bandwidth (read + written bytes per second)
    launch_s: float  # fixed cost of one step (kernel launch, Python)
    source: str = "stated defaults"
    # measured latent rates of single cache formats ((format, FLOP/s), ...), over latent_flops
    latent_by_format: tuple = ()

    def latent_rate(self, kv_cache_dtype: str | None) -> float:
        return dict(self.latent_by_format).get(kv_cache_dtype, self.latent_flops)

    def describe(self) -> str:
        return (f"GEMM {self.gemm_flops / 1e12:.4g} TFLOP/s, attention {self.attention_flops / 1e12:.4g}, "
                f"latent {self.latent_flops / 1e12:.4g}, memory {self.bytes_per_s / 1e9:.4g} GB/s, "
                f"launch {self.launch_s * 1e6:.3g} us"
                + "".join(f", latent[{k}] {v / 1e12:.4g}" for k, v in self.latent_by_format)
                + f" ({self.source})")


# Stated defaults (no measurement for the device). CUDA: the H200 numbers of
# SPEC §11 (~790 TFLOP/s bf16 GEMM, ~4.3 TB/s copy), derated to 600 TFLOP/s
# and 3.5 TB/s, the same rate for every FLOP (so the crossover is the FLOP
# count's). CPU: the torch paths of a small build machine (one thread).
STATED = {
    "cuda": Rates(600e12, 600e12, 600e12, 3.5e12, 5e-6,
                  "stated defaults for CUDA (SPEC §11 H200 figures, derated; one rate for every FLOP)"),
    "cpu": Rates(5e10, 5e10, 5e10, 1e10, 2e-5, "stated defaults for the CPU (one rate for every FLOP)"),
}

_RATES_LOCK = threading.Lock()
_RATES: dict[tuple, Rates] = {}


def device_name(device: torch.device) -> str:
    """The name a measurement table is filed under: the CUDA device name, else the type."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return device.type  # (explain() may ask about a CUDA device on a machine without one)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_name(idx)


def _rate(v) -> float | None:
    """A measured rate as a finite float > 0, else None (never raises: a 400-digit
    integer in a table is an OverflowError for float())."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) and f > 0 else None


def rates_from_table(device_name_: str, directory: str | None = None) -> tuple[Rates | None, str]:
    """The measured rates for a device, or None and why not."""
    directory = directory or D.tables_dir()
    if directory is None:
        return None, f"dispatch tables are off ({D.TABLES_ENV})"
    path = D.table_path(device_name_, directory)
    data, err = D.read_table(path)
    if err is not None:
        return None, f"dispatch table {path} is unusable ({err})"
    if data is None:
        return None, f"no measurement for {device_name_}"
    sec = data["ops"].get(OP)
    r = sec.get("rates") if isinstance(sec, dict) else None
    if not isinstance(r, dict):
        return None, f"no {OP} rates for {device_name_} in {path}"
    vals = [_rate(r.get(k)) for k in RATE_KEYS]
    if None in vals:
        why = f"{OP} rates must be finite and > 0, numbers for {', '.join(RATE_KEYS)}"
        D.warn_table(path, f"{why}; the {OP} rates are ignored (stated defaults)")
        return None, f"{path}: {why}"
    by_fmt = r.get("latent_flops_by_format", {})
    by_fmt = tuple(sorted((str(k), _rate(v)) for k, v in by_fmt.items() if _rate(v) is not None)) \
        if isinstance(by_fmt, dict) else ()
    return Rates(*vals, source=f"measured: {path} [{OP}] ({sec.get('source', 'no source given')})",
                 latent_by_format=by_fmt), ""


def rates_for(device: torch.device | str) -> Rates:
    """Measured rates for `device` (cached per device name and table folder), else STATED."""
    device = torch.device(device)
    name = device_name(device)
    key = (name, D.tables_dir())
    hit = _RATES.get(key)
    if hit is not None:
        return hit
    with _RATES_LOCK:
        measured, why = rates_from_table(name)
        if measured is None:
            base = STATED["cuda" if device.type == "cuda" else "cpu"]
            measured = Rates(base.gemm_flops, base.attention_flops, base.latent_flops, base.bytes_per_s,
                             base.launch_s, f"{base.source}; {why}")
        _RATES[key] = measured
    return measured


def clear_rates_cache() -> None:
    with _RATES_LOCK:
        _RATES.clear()


@dataclass(frozen=True)
class Dims:
    """What the cost depends on besides the chunk: the layer's dims and byte widths."""

    L: int
    R: int
    P: int
    V: int
    N: int
    entry_bytes: int  # cache bytes per token
    act_bytes: int  # bytes per element of the compute dtype
    kv_cache_dtype: str | None = None  # picks a measured per-format latent rate

    @classmethod
    def of_layer(cls, layer) -> "Dims":
        m = layer.model
        return cls(m.L, m.R, m.P, m.V, m.num_heads, layer.spec.bytes_per_token,
                   torch.empty(0, dtype=m.model_dtype).element_size(), layer.spec.format.name)


@dataclass(frozen=True)
class PathCost:
    path: str
    flops: float
    bytes: float
    seconds: float
    steps: dict = field(default_factory=dict)  # step -> predicted seconds


def _step(flops: float, nbytes: float, flop_rate: float, r: Rates) -> float:
    return max(flops / flop_rate, nbytes / r.bytes_per_s) + r.launch_s


def path_costs(d: Dims, ctx_lens, q_lens, rates: Rates, *, absorbed_gathers: bool = False
               ) -> tuple[PathCost, PathCost]:
    """(up_project, absorbed) predicted costs of one chunk: request r has ctx_lens[r]
    context rows and q_lens[r] query rows in it. `absorbed_gathers`: the absorbed
    path gathers the rows first too (its torch path; context parallelism)."""
    if len(ctx_lens) != len(q_lens):
        raise ValueError(f"q_lens: expected {len(ctx_lens)} entries (as ctx_lens), got {len(q_lens)}")
    L, R, P, V, N, e, a = d.L, d.R, d.P, d.V, d.N, d.entry_bytes, d.act_bytes
    C = float(sum(ctx_lens))
    T = float(sum(q_lens))
    pairs = float(sum(c * q for c, q in zip(ctx_lens, q_lens)))
    NPV = N * (P + V)
    gather = (0.0, C * (e + (L + R) * a))
    up = {
        "gather": gather,
        "kv_b_proj": (2 * C * L * NPV, C * L * a + NPV * L * a + C * NPV * a),
        "attention": (2 * pairs * N * (P + R + V), C * (NPV + R) * a + T * N * (P + R + V) * a),
    }
    up_rate = {"gather": rates.gemm_flops, "kv_b_proj": rates.gemm_flops, "attention": rates.attention_flops}
    ab = {
        "absorb": (2 * T * N * P * L, T * N * P * a + N * P * L * a + T * N * L * a),
        "attention": (2 * pairs * N * (2 * L + R), C * e + T * N * (L + R) * a + T * N * L * a),
        "unabsorb": (2 * T * N * L * V, T * N * L * a + N * L * V * a + T * N * V * a),
    }
    ab_rate = {"absorb": rates.gemm_flops, "attention": rates.latent_rate(d.kv_cache_dtype),
               "unabsorb": rates.gemm_flops}
    if absorbed_gathers:
        ab = {"gather": gather, **ab}
        ab_rate["gather"] = rates.gemm_flops

    def total(name, steps, rate) -> PathCost:
        secs = {s: _step(f, b, rate[s], rates) for s, (f, b) in steps.items()}
        return PathCost(name, sum(f for f, _ in steps.values()), sum(b for _, b in steps.values()),
                        sum(secs.values()), secs)

    return total("up_project", up, up_rate), total("absorbed", ab, ab_rate)


@dataclass(frozen=True)
class Choice:
    path: str  # "absorbed" or "up_project"
    reason: str
    up: PathCost | None = None
    absorbed: PathCost | None = None


def choose(d: Dims, ctx_lens, q_lens, rates: Rates, *, absorbed_gathers: bool = False) -> Choice:
    """The cheaper path for one chunk by the cost model (ties: up_project, today's path)."""
    up, ab = path_costs(d, ctx_lens, q_lens, rates, absorbed_gathers=absorbed_gathers)
    path = "absorbed" if ab.seconds < up.seconds else "up_project"
    why = (f"cost model: absorbed {ab.seconds * 1e6:.4g} us vs up_project {up.seconds * 1e6:.4g} us "
           f"({sum(ctx_lens)} context rows, {sum(q_lens)} query rows, {len(ctx_lens)} requests)")
    return Choice(path, why, up, ab)


def crossover_new_tokens(d: Dims, context_rows: int, rates: Rates, *, absorbed_gathers: bool = False,
                         limit: int = 1 << 24) -> float:
    """New tokens per request below which the absorbed path is predicted faster, for
    one request with `context_rows` rows in a chunk: the smallest T at which
    up_project costs no more than absorbed. 0.0: absorbed never wins; inf: it
    always does (up to `limit`)."""
    if context_rows <= 0:
        return 0.0

    def absorbed_wins(t: int) -> bool:
        up, ab = path_costs(d, [context_rows], [t], rates, absorbed_gathers=absorbed_gathers)
        return ab.seconds < up.seconds

    if not absorbed_wins(1):
        return 0.0
    if absorbed_wins(limit):
        return math.inf
    lo, hi = 1, limit  # absorbed wins at lo, loses at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if absorbed_wins(mid):
            lo = mid
        else:
            hi = mid
    return float(hi)


def flop_crossover(L: int, P: int, V: int) -> float:
    """The pure FLOP-count crossover L(P+V) / (2L - P - V) (inf when 2L <= P+V)."""
    den = 2 * L - P - V
    return math.inf if den <= 0 else L * (P + V) / den


def write_rates(path: str, device_name_: str, rates: dict, entries: dict | None = None, source: str = "") -> dict:
    """Merges measured `rates` (RATE_KEYS -> number, optionally "latent_flops_by_format":
    {format: number}) and optional measured buckets
    ({bucket: {"order": [...], "us": {...}}}) into the dispatch table at `path`, as
    the "context_attention" section (other ops' sections are kept). Returns the table."""
    import json
    import os

    bad = [k for k in RATE_KEYS if not (isinstance(rates.get(k), (int, float)) and math.isfinite(rates[k])
                                        and rates[k] > 0)]
    if bad:
        raise ValueError(f"rates: expected finite numbers > 0 for {bad}, got {rates}")
    D.write_table_entries(path, device_name_, OP, dict(entries or {}), source)
    with open(path) as f:
        data = json.load(f)
    data["ops"][OP]["rates"] = {k: float(rates[k]) for k in RATE_KEYS}
    by_fmt = rates.get("latent_flops_by_format")
    if by_fmt:
        data["ops"][OP]["rates"]["latent_flops_by_format"] = {str(k): float(v) for k, v in by_fmt.items()}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    D.clear_table_cache()
    clear_rates_cache()
    return data
