"""One backend registry for every op with more than one implementation.

In the style of xformers' attention dispatch: each backend states
`not_supported_reasons(inputs)`; the dispatcher picks the first backend (in
priority order) with none, otherwise raises one error listing every backend's
reasons. The choice is inspectable (`explain`) and can be forced, for tests
and benchmarks, with `Dispatcher.force(name)` or the environment variable
MLA_EXT_FORCE_<OP>=<backend> (e.g. MLA_EXT_FORCE_GATHER=triton_paged).

Capability vs performance. A backend's `reasons` say what it cannot do (device,
architecture, dtype, shape limits). Its optional `heuristic` states the
performance rules of the stated order (e.g. "M > MARLIN_MAX_M"): they apply only
when nothing better is known. Forcing a backend ignores them, and so does a
measurement:

Dispatch by measurement. A dispatcher built with `table_key=` (a callable
inputs -> (device name, bucket), bucket being a key or a list of keys tried in
order) reads the table committed for that device,
mla_ext/dispatch_tables/<device_slug(name)>.json:

    {"format": 1, "device": "NVIDIA H200",
     "ops": {"<op>": {"source": "how it was measured",
                      "entries": {"<bucket>": {"order": ["fastest", "next", ...],
                                               "us": {"fastest": 12.5, ...}}}}}}

For a bucket in the table it takes the first backend of `order` (measured
fastest first) that can serve the inputs; with no table for the device, no entry
for the bucket, or no usable measured backend, it falls back to the stated order.
`explain()` says which: the file, the key and the measured numbers, or
"no measurement for <device>: stated order". MLA_EXT_DISPATCH_TABLES=<dir> reads
the tables from another folder; MLA_EXT_DISPATCH_TABLES=off ignores them.

A table never makes a call fail (nor blocks one). A table path that is not a
regular file (a FIFO, a directory, a device, a socket) is never opened; it, a file
over MAX_TABLE_BYTES, one that does not parse (truncated, nested past the parser's recursion limit, ...) or does not
follow the schema above (every measured time a finite number) is ignored: one
warning (TableWarning) names the file and the reason, and `explain()` repeats it.
Backend names an op does not have (a typo) are refused when the op first reads its
section: one warning per op and table names them, they are dropped from every
entry (so never shown as measured), and an entry left without a backend is no
measurement. `write_table_entries()` merges measured entries into a table file
(the benchmarks use it).

Resolved once. `Dispatcher.run(inputs, chosen)` with a `Chosen` (one call site) decides at the
site's first call and reuses that backend for the later ones, skipping every backend's reasons
and heuristics; MLAPrefill keeps one per op call site and batch (mla_ext/prefill/backends.py),
keyed by what the choice depends on, `dispatch_state()` (forced backends, tables) included.

A backend named "triton" or "triton_<...>" runs Triton kernels: besides its
own reasons it reports those of the installed Triton itself, which matter
under TRITON_INTERPRET=1 (`mla_ext.compat.triton_interpreter_reasons`: e.g. an
interpreter that this numpy breaks), so the dispatcher falls back to the next
backend instead of failing inside the kernel.

Imports nothing from the rest of the package except mla_ext.compat (which
imports nothing either), lazily.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from mla_ext.compat import triton_interpreter_reasons

TABLE_FORMAT = 1
TABLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dispatch_tables")
TABLES_ENV = "MLA_EXT_DISPATCH_TABLES"
_TABLES_OFF = ("off", "0", "none")
# A measurement table is a few hundred entries (kilobytes); a larger file is not
# one and is not read whole.
MAX_TABLE_BYTES = 4 << 20


class TableWarning(UserWarning):
    """A dispatch table (or part of one) is ignored; the message names the file and why."""


class NoBackendError(ValueError):
    """No backend can serve the inputs; the message lists every backend's reasons."""


@dataclass(frozen=True)
class Backend:
    """A named implementation.

    `reasons(inputs)` returns a list of human-readable reasons why this backend
    cannot serve `inputs` (empty list: it can). `run(inputs)` does the work.
    `heuristic(inputs)` (optional) returns the stated order's performance rules
    that speak against it for these inputs (e.g. an M threshold); they are
    ignored when the backend is forced or a measurement decides.
    """

    name: str
    reasons: Callable[[Any], list[str]]
    run: Callable[[Any], Any]
    heuristic: Callable[[Any], list[str]] | None = None

    def not_supported_reasons(self, inputs: Any) -> list[str]:
        why = list(self.reasons(inputs))
        if is_triton_backend(self.name):
            why += triton_interpreter_reasons()  # [] unless interpreting; probed once
        return why

    def heuristic_reasons(self, inputs: Any) -> list[str]:
        return [] if self.heuristic is None else list(self.heuristic(inputs))


def is_triton_backend(name: str) -> bool:
    """The naming convention for backends that run Triton kernels."""
    return name == "triton" or name.startswith("triton_")


# -- measured dispatch tables ---------------------------------------------------

def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200': the table file name of a device."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"device name: expected a non-empty str, got {name!r}")
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def tables_dir() -> str | None:
    """The folder the tables are read from (None: tables are off)."""
    env = os.environ.get(TABLES_ENV)
    if env is None or env == "":
        return TABLES_DIR
    return None if env.lower() in _TABLES_OFF else env


def table_path(device_name: str, directory: str | None = None) -> str:
    return os.path.join(directory or TABLES_DIR, device_slug(device_name) + ".json")


@dataclass(frozen=True)
class TableEntry:
    """One measured bucket of one op on one device."""

    path: str
    device: str
    op: str
    key: str
    order: tuple[str, ...]
    us: dict = field(default_factory=dict)
    requested: str = ""   # the bucket asked for, when a neighbouring key matched

    def numbers(self) -> str:
        parts = []
        for name in self.order:
            t = self.us.get(name)
            parts.append(f"{name} {t:.4g} us" if isinstance(t, (int, float)) else name)
        return ", ".join(parts)

    def describe(self) -> str:
        near = f" (nearest measured bucket to {self.requested!r})" if self.requested and self.requested != self.key else ""
        return f"dispatch table {self.path} [{self.op}] {self.key!r}{near}: measured {self.numbers()}"


_TABLE_LOCK = threading.Lock()
_TABLE_CACHE: dict[str, tuple[dict | None, str | None]] = {}
_LOOKUPS: dict[tuple, tuple["TableEntry | None", str]] = {}  # (dir, op, device, keys) -> lookup()


_GENERATION = [0]  # bumped whenever the tables read so far are forgotten (a resolved choice may change)


def clear_table_cache() -> None:
    """Forget the tables read so far (they are read once per process)."""
    with _TABLE_LOCK:
        _GENERATION[0] += 1
        _TABLE_CACHE.clear()
        _LOOKUPS.clear()
        _WARNED.clear()


def _finite_number(v: Any) -> bool:
    """A JSON number that is a finite float (not a bool, NaN, inf, nor an int past float range)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _validate_table(data: Any, path: str) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != TABLE_FORMAT:
        raise ValueError(f"'format' must be {TABLE_FORMAT}, got {data.get('format')!r}")
    ops = data.get("ops")
    if not isinstance(ops, dict):
        raise ValueError("'ops' must be an object {op: {'entries': {...}}}")
    for op, sec in ops.items():
        entries = sec.get("entries") if isinstance(sec, dict) else None
        if not isinstance(entries, dict):
            raise ValueError(f"ops[{op!r}] must be an object with an 'entries' object")
        for key, e in entries.items():
            order = e.get("order") if isinstance(e, dict) else None
            if not isinstance(order, list) or not order or not all(isinstance(n, str) for n in order):
                raise ValueError(f"ops[{op!r}].entries[{key!r}].order must be a non-empty list of backend names")
            us = e.get("us", {})
            if not isinstance(us, dict) or not all(_finite_number(v) for v in us.values()):
                raise ValueError(f"ops[{op!r}].entries[{key!r}].us must map backend names to finite numbers")
    return data


def read_table(path: str) -> tuple[dict | None, str | None]:
    """(table, None), (None, None) when the file does not exist, or (None, why) when
    it cannot be used. Read once per path and process (see clear_table_cache)."""
    with _TABLE_LOCK:
        hit = _TABLE_CACHE.get(path)
        if hit is not None:
            return hit
        if not os.path.exists(path):
            res: tuple[dict | None, str | None] = (None, None)
        else:
            res = (None, _parse_table(path))
            if isinstance(res[1], dict):
                res = (res[1], None)
            else:
                warn_table(path, f"ignored: {res[1]}; dispatch uses the stated order")
        _TABLE_CACHE[path] = res
        return res


def _not_regular(mode: int) -> str:
    """'' for a regular file, else what the file is (a table is only ever read from a regular file)."""
    if stat.S_ISREG(mode):
        return ""
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _parse_table(path: str) -> dict | str:
    """The validated table at `path`, or why it cannot be used. Reads at most
    MAX_TABLE_BYTES + 1 bytes; every exception (a RecursionError from deep nesting,
    a MemoryError, a decode error, ...) is a reason, never raised."""
    try:
        kind = _not_regular(os.stat(path).st_mode)
        if kind:  # a FIFO would block open() (and so every dispatch) forever: never opened
            return f"not a regular file ({kind}); never opened"
        # O_NONBLOCK: a file swapped for a FIFO after the stat still cannot block the open.
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            kind = _not_regular(os.fstat(f.fileno()).st_mode)
            if kind:
                return f"not a regular file ({kind}); not read"
            raw = f.read(MAX_TABLE_BYTES + 1)
        if len(raw) > MAX_TABLE_BYTES:
            return f"larger than MAX_TABLE_BYTES={MAX_TABLE_BYTES} bytes (not a measurement table)"
        return _validate_table(json.loads(raw.decode("utf-8")), path)
    except Exception as exc:  # noqa: BLE001 - a table never fails dispatch
        msg = str(exc)
        return f"{type(exc).__name__}: {msg[:200] + '...' if len(msg) > 200 else msg}"


_WARNED: set[tuple[str, str]] = set()


def warn_table(path: str, why: str) -> None:
    """One TableWarning per (file, reason) and process."""
    if (path, why) in _WARNED:
        return
    _WARNED.add((path, why))
    warnings.warn(f"dispatch table {path}: {why}", TableWarning, stacklevel=3)


def lookup(op: str, device_name: str, buckets: str | Sequence[str],
           directory: str | None = None, known: Sequence[str] | None = None) -> tuple[TableEntry | None, str]:
    """The table entry for `op` on `device_name` (the first of `buckets` present),
    or None and why not (the explanation ends with ': stated order'). `known`: the
    op's backend names; others in the table are refused (one warning) and dropped."""
    keys = (buckets,) if isinstance(buckets, str) else tuple(buckets)
    directory = directory or tables_dir()
    if directory is None:
        return None, f"dispatch tables are off ({TABLES_ENV}={os.environ.get(TABLES_ENV)}): stated order"
    known = None if known is None else tuple(known)
    memo = (directory, op, device_name, keys, known)
    hit = _LOOKUPS.get(memo)  # per call on the dispatch path: the answer is kept
    if hit is None:
        hit = _LOOKUPS[memo] = _lookup(op, device_name, keys, directory, known)
    return hit


def _known_only(path: str, op: str, sec: dict, known: tuple[str, ...] | None) -> dict:
    """`sec`'s entries with only the backends `op` has; one warning names the others."""
    if known is None:
        return sec["entries"]
    unknown = sorted({n for e in sec["entries"].values() for n in list(e["order"]) + list(e.get("us", {}))
                      if n not in known})
    if not unknown:
        return sec["entries"]
    warn_table(path, f"op {op!r} has no backend named {', '.join(map(repr, unknown))} (expected one of "
                     f"{list(known)}); those measurements are ignored")
    out = {}
    for key, e in sec["entries"].items():
        order = [n for n in e["order"] if n in known]
        if order:
            out[key] = {"order": order, "us": {n: t for n, t in e.get("us", {}).items() if n in known}}
    return out


def _lookup(op: str, device_name: str, keys: tuple, directory: str,
            known: tuple[str, ...] | None = None) -> tuple[TableEntry | None, str]:
    path = table_path(device_name, directory)
    data, err = read_table(path)
    if err is not None:
        return None, f"dispatch table {path} is unusable ({err}): stated order"
    if data is None:
        return None, f"no measurement for {device_name}: stated order"
    if data.get("device") not in (None, device_name):
        return None, f"dispatch table {path} was measured on {data.get('device')!r}, not {device_name!r}: stated order"
    sec = data["ops"].get(op)
    if sec is None:
        return None, f"no measurement for {device_name} in {path} for op {op!r}: stated order"
    entries = _known_only(path, op, sec, known)
    for key in keys:
        e = entries.get(key)
        if e is not None:
            return TableEntry(path, device_name, op, key, tuple(e["order"]), dict(e.get("us", {})),
                              requested=keys[0] if keys else ""), ""
    return None, f"no measurement for {device_name} in {path} for {op} {keys[0] if keys else ''!r}: stated order"


def write_table_entries(path: str, device_name: str, op: str, entries: dict, source: str = "") -> dict:
    """Merge `entries` ({bucket: {"order": [...], "us": {...}}}) for `op` into the table
    at `path` (created if missing; other ops' sections are kept, this op's entries with
    the same keys are replaced). Returns the table written."""
    data = _parse_table(path) if os.path.exists(path) else None
    if not isinstance(data, dict):
        data = None  # an unusable file is replaced
    if data is None or data.get("device") not in (None, device_name):
        data = {"format": TABLE_FORMAT, "device": device_name, "ops": {}}
    sec = data["ops"].setdefault(op, {"entries": {}})
    if source:
        sec["source"] = source
    sec["entries"].update(entries)
    _validate_table(data, path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    clear_table_cache()
    return data


def pow2_buckets(m: int, octaves: int = 3) -> list[int]:
    """M rounded up to a power of two, then its neighbours up to `octaves` away,
    nearest first (below before above): [2^i, 2^(i-1), 2^(i+1), ...], all >= 1."""
    top = 1 if m <= 1 else 1 << math.ceil(math.log2(m))
    out = [top]
    for d in range(1, octaves + 1):
        if top >> d >= 1:
            out.append(top >> d)
        out.append(top << d)
    return out


# -- the dispatcher -------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    """The chosen backend and how it was chosen (one line)."""

    backend: Backend
    how: str
    entry: TableEntry | None = None


class Dispatcher:
    """`table_key(inputs) -> (device_name, bucket or [buckets])` turns on dispatch by
    measurement (module docstring); without it, the stated order decides."""

    def __init__(self, op: str, backends: list[Backend] | None = None,
                 table_key: Callable[[Any], tuple[str, Any]] | None = None,
                 tables_dir: str | None = None):
        self.op = op
        self._backends: list[Backend] = list(backends or [])
        self._forced: str | None = None
        self.table_key = table_key
        self.tables_dir = tables_dir  # None: mla_ext/dispatch_tables or $MLA_EXT_DISPATCH_TABLES

    # -- registry ---------------------------------------------------------
    def register(self, backend: Backend) -> Backend:
        if any(b.name == backend.name for b in self._backends):
            raise ValueError(f"{self.op}: backend {backend.name!r} is already registered")
        self._backends.append(backend)
        return backend

    @property
    def backends(self) -> list[Backend]:
        return list(self._backends)

    def get(self, name: str) -> Backend:
        for b in self._backends:
            if b.name == name:
                return b
        raise ValueError(
            f"{self.op}: unknown backend {name!r}; expected one of "
            f"{[b.name for b in self._backends]}"
        )

    # -- choice -----------------------------------------------------------
    def _forced_name(self) -> str | None:
        env = os.environ.get(f"MLA_EXT_FORCE_{self.op.upper()}")
        return self._forced or (env or None)

    def reasons_by_backend(self, inputs: Any) -> dict[str, list[str]]:
        return {b.name: b.not_supported_reasons(inputs) for b in self._backends}

    def table_entry(self, inputs: Any) -> tuple[TableEntry | None, str]:
        """The measurement that applies to `inputs`, or None and why not."""
        if self.table_key is None:
            return None, "stated order"
        try:
            device_name, buckets = self.table_key(inputs)
        except Exception as exc:  # noqa: BLE001 - a table problem never fails dispatch
            return None, f"dispatch table key failed ({type(exc).__name__}: {exc}): stated order"
        d = self.tables_dir
        if d is None and tables_dir() is None:
            return None, f"dispatch tables are off ({TABLES_ENV}={os.environ.get(TABLES_ENV)}): stated order"
        try:
            return lookup(self.op, device_name, buckets, d, known=[b.name for b in self._backends])
        except Exception as exc:  # noqa: BLE001 - read_table catches its own; this is the last guard
            return None, f"dispatch table lookup failed ({type(exc).__name__}: {exc}): stated order"

    def decide(self, inputs: Any) -> Decision:
        """The backend for `inputs` and how it was chosen; NoBackendError if none can serve."""
        forced = self._forced_name()
        if forced is not None:
            b = self.get(forced)
            why = b.not_supported_reasons(inputs)
            if why:
                raise NoBackendError(
                    f"{self.op}: forced backend {forced!r} cannot serve these inputs: "
                    + "; ".join(why)
                )
            return Decision(b, f"forced (Dispatcher.force or MLA_EXT_FORCE_{self.op.upper()})")
        entry, how = self.table_entry(inputs)
        if entry is not None:
            known = {b.name: b for b in self._backends}
            for name in entry.order:
                b = known.get(name)
                if b is not None and not b.not_supported_reasons(inputs):
                    return Decision(b, "measured fastest usable backend: " + entry.describe(), entry)
            how = f"{entry.describe()}; none of these can serve these inputs: stated order"
        all_reasons = {}
        for b in self._backends:
            why = b.not_supported_reasons(inputs) + b.heuristic_reasons(inputs)
            if not why:
                return Decision(b, how)
            all_reasons[b.name] = why
        lines = [f"  {name}: {'; '.join(why)}" for name, why in all_reasons.items()]
        raise NoBackendError(f"{self.op}: no backend supports these inputs:\n" + "\n".join(lines))

    def choose(self, inputs: Any) -> Backend:
        return self.decide(inputs).backend

    def explain(self, inputs: Any) -> str:
        """One line per backend: chosen / usable / why not; with a table_key (or when
        forced), a line saying how the choice was made."""
        try:
            d = self.decide(inputs)
            chosen, how = d.backend.name, d.how
            by_rules = d.entry is None and not self._forced_name()
        except NoBackendError:
            chosen, by_rules = None, True
            forced = self._forced_name()
            if forced is not None:
                how = f"forced {forced!r}, which cannot serve these inputs"
            else:
                how = self.table_entry(inputs)[1] if self.table_key is not None else "stated order"
        out = [f"{self.op}: " + (f"uses {chosen!r}" if chosen else "no usable backend")]
        if self.table_key is not None or self._forced_name():
            out.append(f"  choice: {how}")
        for b in self._backends:
            why = b.not_supported_reasons(inputs)
            if by_rules:
                why += b.heuristic_reasons(inputs)
            mark = "*" if b.name == chosen else (" " if not why else "x")
            out.append(f"  [{mark}] {b.name}" + (f": {'; '.join(why)}" if why else ""))
        return "\n".join(out)

    def __call__(self, inputs: Any) -> Any:
        return self.choose(inputs).run(inputs)

    def run(self, inputs: Any, chosen: "Chosen | None" = None) -> Any:
        """`self(inputs)`, or with `chosen` (a call site resolved once per batch) its backend:
        chosen by this dispatcher at the site's first call, reused by every later one."""
        if chosen is None:
            return self.choose(inputs).run(inputs)
        return chosen.pick(self, inputs).run(inputs)

    @contextlib.contextmanager
    def force(self, name: str | None) -> Iterator[None]:
        """Within the block, always use backend `name` (None: normal choice)."""
        if name is not None:
            self.get(name)
        prev, self._forced = self._forced, name
        try:
            yield
        finally:
            self._forced = prev


def dispatch_state(dispatchers: Sequence[Dispatcher]) -> tuple:
    """What the choices of `dispatchers` depend on besides their inputs: each one's forced backend
    (Dispatcher.force, MLA_EXT_FORCE_<OP>) and tables folder, the tables' environment variable and
    generation (bumped by clear_table_cache). A choice resolved once is reused only while this is
    unchanged; it runs on every layer call, so the environment is read once per variable."""
    env = os.environ
    return (env.get(TABLES_ENV), _GENERATION[0]) + tuple(
        (d._forced or env.get("MLA_EXT_FORCE_" + d.op.upper()) or None, d.tables_dir) for d in dispatchers)


class Chosen:
    """One call site's backend, resolved by the dispatcher at the site's first call and reused
    by the later ones (MLAPrefill resolves each op of a batch once: mla_ext/prefill/backends.py).
    The caller vouches that every call through one site has inputs the dispatcher would decide
    alike (same devices, dtypes, strides and size buckets)."""

    __slots__ = ("backend",)

    def __init__(self) -> None:
        self.backend: Backend | None = None

    def pick(self, dispatcher: Dispatcher, inputs: Any) -> Backend:
        b = self.backend
        if b is None:
            b = self.backend = dispatcher.choose(inputs)
        return b


# -- every dispatcher of the library (for `python -m mla_ext info`) --------------

# The modules that build the library's dispatchers (module-level Dispatcher objects).
# `all_dispatchers()` lists every Dispatcher defined in them, so a new one in any of these
# modules is listed by construction; tests/cli/test_cli_dispatchers.py fails naming a module of
# mla_ext that builds a Dispatcher and is missing here.
DISPATCHER_MODULES = (
    "mla_ext.cache.api", "mla_ext.kv_b_proj.linear", "mla_ext.attention.api", "mla_ext.attention.latent",
    "mla_ext.sparse.index_cache_backends", "mla_ext.sparse.sparse_attention",
    "mla_ext.sparse.slot_attention",
    "mla_ext.sparse.mqa_logits", "mla_ext.sparse.indexer_q_quant", "mla_ext.vllm.dsa_model_ops",
)


def all_dispatchers() -> list[Dispatcher]:
    """Every module-level Dispatcher of DISPATCHER_MODULES (imported here), in that order."""
    import importlib

    out: list[Dispatcher] = []
    for name in DISPATCHER_MODULES:
        for obj in vars(importlib.import_module(name)).values():
            if isinstance(obj, Dispatcher) and all(obj is not d for d in out):
                out.append(obj)
    return out


def report_device(device=None):
    """The device a backend_report() probes: `device`, else CUDA when visible, else the CPU."""
    import torch

    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got {device!r}") from None
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
