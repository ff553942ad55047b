"""What the benchmarks share: rows that reach the CSV as they are measured, and
failures that become rows instead of ending the run.

A lent GPU machine is used once, under a deadline: a benchmark that stops at its
first mismatch, or is interrupted before it writes its CSV, returns nothing. So:

- `RowLog` opens the CSV first and appends (and flushes) every row the moment it
  is measured; each row has a `status` ("ok", "mismatch", "error") and an
  `error` message;
- `failure_row(...)` turns an exception into such a row;
- `finish(...)` is the common ending: the summary of whatever rows exist, and
  the exit status (0: every row ok, 1: some row failed, 130: interrupted).
"""
from __future__ import annotations

import csv
import os
import traceback

STATUS_FIELDS = ("status", "error")


def error_text(exc: BaseException, limit: int = 300) -> str:
    """One line: the exception type, its message and where it was raised."""
    msg = " ".join(str(exc).split()) or "(no message)"
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" [{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}]" if tb else ""
    text = f"{type(exc).__name__}: {msg}{where}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cell(v):
    return f"{v:.4g}" if isinstance(v, float) else v


class RowLog:
    """A CSV written row by row. `fields` fixes the columns (status and error
    are appended); a row may leave columns out (an error row has no timings)."""

    def __init__(self, path: str, fields: list[str], extra: dict | None = None):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.extra = dict(extra or {})
        self.fields = [f for f in fields if f not in STATUS_FIELDS] + list(self.extra) + list(STATUS_FIELDS)
        self.rows: list[dict] = []
        self._f = open(path, "w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=self.fields, extrasaction="ignore")
        self._w.writeheader()
        self._f.flush()

    def add(self, row: dict, status: str = "ok", error: str = "") -> dict:
        row = {**row, "status": row.get("status", status), "error": row.get("error", error)}
        self.rows.append(row)
        self._w.writerow({k: _cell(v) for k, v in {**self.extra, **row}.items()})
        self._f.flush()
        return row

    def fail(self, row: dict, exc: BaseException | str, status: str = "error") -> dict:
        """Record a failed measurement; prints it, the run goes on."""
        msg = exc if isinstance(exc, str) else error_text(exc)
        print(f"  {status.upper()}: {' '.join(f'{k}={v}' for k, v in row.items())}: {msg}", flush=True)
        return self.add(row, status, msg)

    def ok(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "ok"]

    def failed(self) -> list[dict]:
        return [r for r in self.rows if r["status"] != "ok"]

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def finish(log: RowLog, interrupted: bool, plot=None) -> int:
    """Close the CSV, draw what was measured (a plot failure is only reported)
    and return the exit status."""
    log.close()
    if plot is not None and log.ok():
        try:
            plot(log.ok())
        except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
            print(f"plot failed: {error_text(exc)}")
    bad = log.failed()
    print(f"{len(log.rows)} rows ({len(bad)} failed){', INTERRUPTED' if interrupted else ''} -> {log.path}")
    for r in bad[:20]:
        print(f"  {r['status']}: {r['error']}")
    return 130 if interrupted else (1 if bad else 0)


def run_rows(log: RowLog, measure, plot=None) -> int:
    """measure(): every row into `log`; Ctrl-C keeps the rows measured so far; then finish()."""
    interrupted = False
    try:
        measure()
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: keeping the rows measured so far", flush=True)
    return finish(log, interrupted, plot)


def pick_device(threads: int) -> str:
    """"cuda" where torch sees a GPU, else "cpu" limited to `threads` threads (timings comparable
    on shared build machines)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    torch.set_num_threads(threads)
    return "cpu"
