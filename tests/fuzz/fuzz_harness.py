"""The fuzz harness: every case runs in its own forked child, every tensor it
passes lives inside guard bytes, every accepted call is checked against the
stage's reference.

Why fork: importing torch and mla_ext costs seconds, forking a parent that has
already imported them costs milliseconds. The parent never initialises CUDA
(the cases are CPU only), so the child inherits a usable torch. A case that
segfaults kills only its child (CRASH), one that loops is SIGKILLed at its
timeout (HANG); the outcome travels back through a pipe.

Outcomes (`OUTCOMES`):
  OK-accepted  the call returned, its result matches the reference, the guard
               bytes around every tensor are intact and no input was written;
  OK-rejected  ValueError/TypeError whose message names the argument the case
               declares (any one of `Case.args`), and nothing was written;
  VAGUE        rejected with another exception type (AttributeError, ...), or
               with a message that does not name the argument;
  WRONG        accepted an input it must refuse, or a result that differs from
               the reference, or guard bytes / read-only inputs were touched,
               or a valid input was refused, or it wrote before refusing;
  CRASH        the child died by a signal (or exited without a result);
  HANG         the child ran past the case's timeout;
  ERROR        the case itself could not be built (a bug in the fuzz suite).

Raw ops (`torch.ops.mla_ext.*`): torch's own schema parser refuses a value of
the wrong Python type with a RuntimeError that names the argument ("Expected a
value of type 'Tensor' for argument 'dst'"); a raw op cannot change that, so
for raw-op cases exactly that RuntimeError counts as a rejection.
"""
from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import pickle
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


OUTCOMES = ("OK-accepted", "OK-rejected", "VAGUE", "WRONG", "CRASH", "HANG", "ERROR")
OK = ("OK-accepted", "OK-rejected")

# Cases that really allocate and write 2**31 bytes and more run only with
# MLA_EXT_FUZZ_BIG=1 (CI skips them; the cheap ones stand in for them).
BIG = os.environ.get("MLA_EXT_FUZZ_BIG", "0") not in ("", "0")
# Children run side by side (the machine has 2 cores; MLA_EXT_FUZZ_JOBS=1 for serial).
JOBS = max(1, int(os.environ.get("MLA_EXT_FUZZ_JOBS", "2")))
DEFAULT_TIMEOUT = 60.0
QUICK = 12.0  # cases that must be refused in O(1): anything slower is a hang (margin for a loaded machine)
# Address-space head room of a child over the parent's: a runaway allocation
# fails (MemoryError / RuntimeError) instead of taking the shared machine down.
CHILD_EXTRA_AS = 4 << 30
BIG_EXTRA_AS = 12 << 30


# ---------------------------------------------------------------------------
# Guard bytes
# ---------------------------------------------------------------------------

GUARD = 1024  # bytes before and after every tensor (keeps 64-byte alignment)
_PATTERN = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0x6A4D))
_BIG_BYTES = 64 << 20  # above this, only the outer guards are filled and checked


def _span_elems(shape, strides) -> int:
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def contiguous_strides(shape, pad: int = 0) -> tuple[int, ...]:
    """Row-major strides; `pad` extra elements after every innermost row."""
    strides, step = [], 1
    for i, n in enumerate(reversed(shape)):
        strides.append(step)
        step *= max(n, 1)
        if i == 0:
            step += pad
    return tuple(reversed(strides))


def _fill_pattern(buf: torch.Tensor) -> None:
    n, at = buf.numel(), 0
    while at < n:
        k = min(n - at, _PATTERN.numel())
        buf[at:at + k].copy_(_PATTERN[:k])
        at += k


@dataclass
class _Region:
    name: str
    buf: torch.Tensor  # uint8, guard + payload + guard
    writable: bool
    big: bool
    snapshot: torch.Tensor | None = None
    guards: tuple[torch.Tensor, torch.Tensor] | None = None
    mask: torch.Tensor | None = None  # bool per byte: True where an element of the view lives


class Guard:
    """Builds every tensor a case passes as a view into a guarded buffer.

    `put(t, name)` copies `t` into a fresh buffer filled with a pseudo-random
    byte pattern, `GUARD` bytes from either end; padding between rows (`pad`)
    and before the first element (`misalign`) holds the pattern too. After
    the call, `verify` reports any byte that changed outside the elements of
    a writable tensor, and any byte of a read-only tensor that changed.
    """

    def __init__(self):
        self.regions: list[_Region] = []
        self.sealed = False

    def put(self, t: torch.Tensor | None, name: str, *, writable: bool = False, pad: int = 0,
            misalign: int = 0, strides=None, shape=None, dtype=None) -> torch.Tensor:
        """A guarded copy of `t` (or, with t None, an uninitialised tensor of `shape`/`dtype`).

        pad: extra elements after each innermost row; misalign: elements the
        start is shifted by (a data pointer aligned to the element size only);
        strides: explicit element strides (overrides pad)."""
        shape = tuple(t.shape if t is not None else shape)
        dtype = t.dtype if t is not None else dtype
        strides = tuple(strides) if strides is not None else contiguous_strides(shape, pad)
        item = torch.empty((), dtype=dtype).element_size()
        nbytes = (_span_elems(shape, strides) + misalign) * item
        payload = -(-nbytes // 64) * 64
        buf = torch.empty(GUARD + payload + GUARD, dtype=torch.uint8)
        big = payload > _BIG_BYTES
        if big:
            _fill_pattern(buf[:GUARD])
            _fill_pattern(buf[GUARD + payload:])
        else:
            _fill_pattern(buf)
        start = GUARD + misalign * item
        flat = buf[start:start + nbytes - misalign * item].view(dtype)
        view = flat.as_strided(shape, strides)
        if t is not None:
            view.copy_(t)
        region = _Region(name, buf, writable, big)
        if writable and not big:
            region.mask = _element_mask(buf.numel(), start, shape, strides, item)
        self.regions.append(region)
        if self.sealed:  # made inside the call: checked from here on
            self._seal(region)
        return view

    def raw(self, nbytes: int, name: str, *, writable: bool = True) -> torch.Tensor:
        """A guarded uint8 payload of `nbytes` (pattern-filled), to carve views from."""
        return self.put(None, name, writable=writable, shape=(nbytes,), dtype=torch.uint8)

    def seal(self) -> None:
        """Snapshot every buffer (called by the harness right before the call)."""
        self.sealed = True
        for r in self.regions:
            self._seal(r)

    @staticmethod
    def _seal(r: _Region) -> None:
        if r.big:
            r.guards = (r.buf[:GUARD].clone(), r.buf[-GUARD:].clone())
        else:
            r.snapshot = r.buf.clone()

    def verify(self, accepted: bool) -> list[str]:
        """Problems found after the call (empty: all guards and inputs intact).

        accepted=False (the call raised): no byte of any buffer may have changed."""
        problems = []
        for r in self.regions:
            if r.big:
                lo, hi = r.guards
                if not (torch.equal(lo, r.buf[:GUARD]) and torch.equal(hi, r.buf[-GUARD:])):
                    problems.append(f"{r.name}: guard bytes around it were overwritten")
                continue
            changed = r.buf != r.snapshot
            if not bool(changed.any()):
                continue
            if not accepted:
                problems.append(f"{r.name}: written although the call was refused")
            elif r.writable:
                outside = changed & ~r.mask
                if bool(outside.any()):
                    first = int(outside.nonzero()[0, 0]) - GUARD
                    problems.append(f"{r.name}: {int(outside.sum())} bytes written outside its elements "
                                    f"(first at byte {first} from its buffer's payload start)")
            else:
                first = int(changed.nonzero()[0, 0]) - GUARD
                where = "guard bytes" if first < 0 or first >= r.buf.numel() - 2 * GUARD else "contents"
                problems.append(f"{r.name}: read-only input modified ({int(changed.sum())} bytes, {where}, "
                                f"first at byte {first})")
        return problems


def _element_mask(total: int, start: int, shape, strides, item: int) -> torch.Tensor:
    mask = torch.zeros(total, dtype=torch.bool)
    if any(n == 0 for n in shape):
        return mask
    offs = torch.zeros((), dtype=torch.int64)
    for d, (n, s) in enumerate(zip(shape, strides)):
        view = [1] * len(shape)
        view[d] = n
        offs = offs + (torch.arange(n, dtype=torch.int64) * s).view(view)
    byte = (offs.reshape(-1, 1) * item + start + torch.arange(item)).reshape(-1)
    mask[byte] = True
    return mask


_SESSION_DIR = tempfile.mkdtemp(prefix="mla_ext_fuzz_")
atexit.register(shutil.rmtree, _SESSION_DIR, True)  # the parent's exit (children leave by os._exit)


def case_dir() -> str:
    """A scratch directory for this case's files (removed with the session's)."""
    path = os.path.join(_SESSION_DIR, str(os.getpid()))
    os.makedirs(path, exist_ok=True)
    return path


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

@dataclass
class Call:
    """What a case does: `fn()` is the call under test; `check(result)` raises
    AssertionError when an accepted call's result is wrong."""

    fn: Callable[[], Any]
    check: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class Case:
    entry: str  # "module:qualname" of the entry point, or "torch.ops.mla_ext.<op>"
    name: str
    build: Callable[[Guard], Call]
    expect: str  # "accept", "reject" or "either"
    args: tuple[str, ...] = ()  # a rejection must name one of these
    timeout: float = DEFAULT_TIMEOUT
    big: bool = False
    raw_op: bool = False
    note: str = ""

    @property
    def id(self) -> str:
        return f"{self.entry}::{self.name}"


REGISTRY: dict[str, list[Case]] = {}


def add(entry: str, name: str, build: Callable[[Guard], Call], expect: str, args=(), *,
        timeout: float = DEFAULT_TIMEOUT, big: bool = False, note: str = "", also=()) -> None:
    """Registers a case. `also`: further entry points the case exercises (for coverage)."""
    if expect not in ("accept", "reject", "either"):
        raise AssertionError(f"expect: {expect!r}")
    if expect != "accept" and not args:
        raise AssertionError(f"case {entry}::{name}: a case that may be refused must name its argument")
    args = (args,) if isinstance(args, str) else tuple(args)
    case = Case(entry, name, build, expect, args, timeout, big, entry.startswith("torch.ops."), note)
    cases = REGISTRY.setdefault(entry, [])
    if any(c.name == name for c in cases):
        raise AssertionError(f"duplicate case {case.id}")
    cases.append(case)
    for other in also:
        ALSO.setdefault(other, []).append(case.id)


ALSO: dict[str, list[str]] = {}


def case(entry: str, name: str, expect: str = "reject", args=(), **kw):
    """Decorator form of `add`."""
    def deco(build):
        add(entry, name, build, expect, args, **kw)
        return build
    return deco


# ---------------------------------------------------------------------------
# The child
# ---------------------------------------------------------------------------

_SCHEMA_ERRORS = ("Expected a value of type", "is missing value for argument", "expected at most",
                  "got an unexpected keyword argument", "Overloaded torch operator invoked")


def _message(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 400 else text[:400] + "..."


def _classify_refusal(case: Case, exc: BaseException, guard: Guard) -> tuple[str, str]:
    text = str(exc)
    what = f"{type(exc).__name__}: {_message(exc)}"
    if case.expect == "accept":
        return "WRONG", f"refused a valid input: {what}"
    schema = case.raw_op and isinstance(exc, RuntimeError) and any(s in text for s in _SCHEMA_ERRORS)
    if not (isinstance(exc, (ValueError, TypeError)) or schema):
        return "VAGUE", f"{what} (expected a ValueError naming {' or '.join(case.args)})"
    if not any(a in text for a in case.args):
        return "VAGUE", f"{what} (the message does not name {' or '.join(case.args)})"
    problems = guard.verify(accepted=False)
    if problems:
        return "WRONG", "; ".join(problems) + f" ({what})"
    return "OK-rejected", what


def _describe(result) -> str:
    if isinstance(result, torch.Tensor):
        return f"a {result.dtype} tensor {tuple(result.shape)}"
    if isinstance(result, tuple):
        return "(" + ", ".join(_describe(r) for r in result) + ")"
    text = repr(result)
    return text if len(text) <= 120 else text[:120] + "..."


def run_in_process(case: Case) -> tuple[str, str]:
    """(outcome, detail) of one case, in this process (the child)."""
    try:
        return _run(case)
    except BaseException as exc:  # noqa: BLE001 - a bug of the harness or the case, reported
        return "ERROR", f"the harness failed: {type(exc).__name__}: {_message(exc)}"


def _run(case: Case) -> tuple[str, str]:
    guard = Guard()
    try:
        call = case.build(guard)
        guard.seal()
    except BaseException as exc:  # noqa: BLE001 - a broken case is reported, not raised
        return "ERROR", f"building the case failed: {type(exc).__name__}: {_message(exc)}"
    try:
        result = call.fn()
    except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, RecursionError too
        return _classify_refusal(case, exc, guard)
    problems = guard.verify(accepted=True)
    if problems:
        return "WRONG", "; ".join(problems)
    if case.expect == "reject":
        return "WRONG", (f"accepted an invalid input (returned {_describe(result)}); expected a "
                         f"ValueError naming {' or '.join(case.args)}")
    if call.check is not None:
        try:
            call.check(result)
        except AssertionError as exc:
            return "WRONG", f"result differs from the reference: {_message(exc)}"
        except BaseException as exc:  # noqa: BLE001
            return "WRONG", f"checking the result failed: {type(exc).__name__}: {_message(exc)}"
    return "OK-accepted", ""


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(case: Case, write_fd: int, out_fd: int) -> None:
    try:
        gc.disable()  # short-lived: a collection would copy every page of the parent's objects
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        faulthandler.enable(file=sys.__stderr__, all_threads=False)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        extra = BIG_EXTRA_AS if case.big else CHILD_EXTRA_AS
        limit = _address_space() + extra
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        torch.set_num_threads(1)
        outcome = run_in_process(case)
        payload = pickle.dumps(outcome)
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view):]
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


# ---------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------

@dataclass
class Result:
    case: Case
    outcome: str
    detail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.outcome in OK

    def line(self) -> str:
        detail = " ".join(self.detail.split())  # one line per case (schema errors span several)
        return f"{self.outcome:<11} {self.case.id}: {detail}".rstrip(": ")


@dataclass
class _Running:
    case: Case
    pid: int
    fd: int
    out: Any
    start: float
    data: bytearray = field(default_factory=bytearray)


def _tail(out) -> str:
    """What the child printed last; for a fatal signal, faulthandler's first (innermost) frames."""
    out.seek(0)
    lines = [ln for ln in out.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    fatal = next((i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")), None)
    if fatal is not None:
        frames = [ln.strip() for ln in lines[fatal + 1:] if ln.strip().startswith("File ")][:3]
        return " | ".join([lines[fatal]] + frames)
    return " | ".join(lines[-6:])


def _finish(run: _Running, killed: bool) -> Result:
    elapsed = time.monotonic() - run.start
    if killed:
        os.kill(run.pid, signal.SIGKILL)
    _, status = os.waitpid(run.pid, 0)
    os.close(run.fd)
    if killed:
        tail = _tail(run.out)
        outcome, detail = "HANG", f"no result after {run.case.timeout:g} s" + (f" ({tail})" if tail else "")
    elif os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        tail = _tail(run.out)
        outcome, detail = "CRASH", f"killed by {sig}" + (f": {tail}" if tail else "")
    elif not run.data:
        tail = _tail(run.out)
        outcome, detail = "CRASH", f"exited with status {os.WEXITSTATUS(status)} without a result" + (
            f": {tail}" if tail else "")
    else:
        outcome, detail = pickle.loads(bytes(run.data))
    run.out.close()
    return Result(run.case, outcome, detail, elapsed)


def _start(case: Case) -> _Running:
    read_fd, write_fd = os.pipe()
    out = tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        os.close(read_fd)
        _child(case, write_fd, out.fileno())
    os.close(write_fd)
    return _Running(case, pid, read_fd, out, time.monotonic())


def run_cases(cases: list[Case], jobs: int = JOBS) -> list[Result]:
    """Runs every case in its own forked child, `jobs` at a time; results in case order."""
    if torch.cuda.is_initialized():
        import pytest

        # Earlier tests of this session used the GPU: a forked child cannot use CUDA, and a
        # backend report probing it there would fail for that reason alone.
        pytest.skip("the fuzz harness forks its cases: CUDA is already initialised in this process "
                    "(run tests/fuzz in a session of its own)")
    pending = list(cases)
    running: dict[int, _Running] = {}
    done: dict[str, Result] = {}
    while pending or running:
        while pending and len(running) < jobs:
            run = _start(pending.pop(0))
            running[run.fd] = run
        now = time.monotonic()
        wait = min(r.start + r.case.timeout - now for r in running.values())
        ready, _, _ = select.select(list(running), [], [], max(0.0, wait))
        for fd in ready:
            run = running[fd]
            chunk = os.read(fd, 1 << 16)
            if chunk:
                run.data += chunk
            else:
                del running[fd]
                done[run.case.id] = _finish(run, killed=False)
        now = time.monotonic()
        for fd, run in list(running.items()):
            if now - run.start > run.case.timeout:
                del running[fd]
                done[run.case.id] = _finish(run, killed=True)
    return [done[c.id] for c in cases]


def run_one(build: Callable[[Guard], Call], timeout: float = DEFAULT_TIMEOUT) -> Result:
    """One valid call (hypothesis examples): must come back OK-accepted."""
    c = Case("property", "example", build, "accept", (), timeout, False, False)
    return run_cases([c], jobs=1)[0]


# ---------------------------------------------------------------------------
# The tally
# ---------------------------------------------------------------------------

ALL_RESULTS: list[Result] = []  # every result of this session (for the summary)
TALLY_COLUMNS = ("cases", "accepted-ok", "rejected-ok", "VAGUE", "WRONG", "CRASH", "HANG", "ERROR")


def tally(results: list[Result]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for r in results:
        row = table.setdefault(r.case.entry, dict.fromkeys(TALLY_COLUMNS, 0))
        row["cases"] += 1
        key = {"OK-accepted": "accepted-ok", "OK-rejected": "rejected-ok"}.get(r.outcome, r.outcome)
        row[key] += 1
    return table


def format_tally(results: list[Result]) -> str:
    table = tally(results)
    if not table:
        return "(no fuzz cases ran)"
    total = dict.fromkeys(TALLY_COLUMNS, 0)
    for row in table.values():
        for k in TALLY_COLUMNS:
            total[k] += row[k]
    names = sorted(table) + ["TOTAL"]
    table["TOTAL"] = total
    width = max(len(n) for n in names)
    head = f"{'entry point':<{width}}  " + "  ".join(f"{c:>11}" for c in TALLY_COLUMNS)
    lines = [head, "-" * len(head)]
    for n in names:
        if n == "TOTAL":
            lines.append("-" * len(head))
        lines.append(f"{n:<{width}}  " + "  ".join(f"{table[n][c]:>11}" for c in TALLY_COLUMNS))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# A case builder shared by the case files (the result checks: helpers.numeric)
# ---------------------------------------------------------------------------

def report_rows_case(report: Callable, *args) -> Callable[["Guard"], Call]:
    """A case calling a `backend_report`-style function: rows of (op, backend, [reasons])."""
    def build(g):
        def check(rows):
            assert rows and all(len(r) == 3 and isinstance(r[2], list) for r in rows), rows
        return Call(lambda: report(*args), check)
    return build
