"""Command line: `python -m mla_ext {plan,info,demo}`.

    plan  per-layer KV-cache formats and the pool plan for a model under a byte budget
    info  what was built (versions, archs, cubins) and what can run here, and why not
    demo  the worked example (mla_ext.demo.run_demo)

Backend report contract (for `info`): each optional op module listed in
`BACKEND_MODULES` may define a module-level function

    backend_report() -> list[tuple[str, str, list[str]]]

returning one `(op, backend, reasons)` tuple per registered backend, where
`reasons` lists why that backend cannot run on this machine (empty: usable).
A module that does not exist yet is shown as "not built yet"; one that fails
to import, or whose report raises, is shown with the error. Nothing else about
those modules is assumed.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import re
import sys
from decimal import Decimal

import torch

from mla_ext import _ext
from mla_ext._args import int_flag, one_line_parser
from mla_ext.dispatch import DISPATCHER_MODULES, all_dispatchers
from mla_ext.config.formats import ALL_NAMES
from mla_ext.config.models import get_model_config, known_model_names
from mla_ext.config.planner import MAX_MEMORY_BYTES, render_plan
from mla_ext.config.policy import CacheConfig
from mla_ext.demo import run_demo

# Every module with a dispatcher (mla_ext.dispatch.DISPATCHER_MODULES), then the indexer's
# top-k, whose backend is an argument rather than a Dispatcher.
BACKEND_MODULES = DISPATCHER_MODULES + ("mla_ext.sparse.topk",)
INT32_MAX = 2**31 - 1  # block sizes and page alignments are int32 in the kernels and the planner
# stdout failures that end the command with one line instead of a traceback: a closed
# pipe (`plan ... | true`), a full disk (`> /dev/full`), a quota, a file too large, I/O.
OUTPUT_ERRNOS = {errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_MEMORY = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")


def parse_memory(text: str) -> int:
    """Bytes from '60GiB', '500MB', '1.5GiB' or '123' (SI and binary units, case-insensitive)."""
    if not isinstance(text, str):
        raise ValueError(f"--memory: expected a size string such as '60GiB', got {type(text).__name__}")
    m = _MEMORY.fullmatch(text)
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise ValueError(
            f"--memory: cannot read {text!r}; expected a number with an optional unit, one of "
            "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 60GiB, 500MB, 123)"
        )
    if len(m.group(1)) > 40:  # more digits than any byte count (and Decimal is exact)
        raise ValueError(f"--memory: {text[:20]!r}... has {len(m.group(1))} digits; expected "
                         f"at most {MAX_MEMORY_BYTES:,} bytes")
    value = int(Decimal(m.group(1)) * unit)
    if value <= 0:
        raise ValueError(f"--memory: {text!r} is less than one byte")
    if value > MAX_MEMORY_BYTES:
        raise ValueError(f"--memory: {text!r} is more than {MAX_MEMORY_BYTES:,} bytes (int64)")
    return value


def _memory_arg(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--memory: ")) from None


def _cmd_plan(args) -> int:
    cfg = CacheConfig(args.kv_cache_dtype, tuple(args.skip_layers), args.block_size,
                      args.calculate_kv_scales)
    print(render_plan(get_model_config(args.model), cfg, args.memory, args.alignment, args.json))
    return 0


def backend_reports() -> list[tuple[str, str | None, list[str]]]:
    """The report rows of every module in BACKEND_MODULES; a module without a usable
    report gives one row (module name, None, [status or report text lines])."""
    rows = []
    for name in BACKEND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            parents = {name.rsplit(".", k)[0] for k in range(name.count("."))}
            if exc.name in parents | {name}:
                rows.append((name, None, ["not built yet"]))
            else:
                rows.append((name, None, [f"failed to import: {exc}"]))
            continue
        except Exception as exc:  # a broken module must not hide the others
            rows.append((name, None, [f"failed to import: {type(exc).__name__}: {exc}"]))
            continue
        report = getattr(mod, "backend_report", None)
        if report is None:
            rows.append((name, None, ["no backend_report() yet"]))
            continue
        try:
            result = report()
            if isinstance(result, str):
                # Not the documented form, but a readable one: show it as is.
                rows.append((name, None, result.splitlines()))
            else:
                rows += [(op, backend, list(reasons)) for op, backend, reasons in result]
        except Exception as exc:
            rows.append((name, None, [f"backend_report() failed: {type(exc).__name__}: {exc}"]))
    return rows


def info_dict() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # triton is optional at run time
        triton_version = f"unavailable ({exc})"
    cuda = torch.cuda.is_available()
    build = _ext.build_info()
    usable, why = _ext.cuda_kernels_usable()
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "cuda_available": cuda,
        "device": torch.cuda.get_device_name() if cuda else None,
        "capability": "sm_%d%d" % torch.cuda.get_device_capability() if cuda else None,
        "library_loaded": build["loaded"],
        "load_error": build.get("error"),
        "so_path": build.get("so_path"),
        "built_with_cuda": build["cuda"],
        "archs": build["archs"],
        "ptx_arch": build.get("ptx_arch", ""),
        "cubins": build.get("cubins", []),
        "ptx": build.get("ptx", []),
        "device_runs": str(_ext.cuda_target()) if usable else None,
        "cuda_kernels_usable": usable,
        "cuda_kernels_why_not": why or None,
        "backends": [
            {"op": op, "backend": b, "reasons": r} for op, b, r in backend_reports()
        ],
        "dispatchers": _dispatcher_rows(),
    }


def _dispatcher_rows() -> list[dict]:
    """Every dispatcher of the library (mla_ext.dispatch.all_dispatchers): its op, its backends
    in the stated order and the one forced (MLA_EXT_FORCE_<OP> or .force()), if any."""
    try:
        found = all_dispatchers()
    except Exception as exc:  # a broken module must not hide the rest of `info`
        return [{"op": f"failed to list the dispatchers: {type(exc).__name__}: {exc}", "backends": [],
                 "forced": None}]
    return [{"op": d.op, "backends": [b.name for b in d.backends], "forced": d._forced_name()} for d in found]


def format_info(d: dict) -> str:
    yes = lambda v: "yes" if v else "no"  # noqa: E731
    lines = [
        f"python           {d['python']}",
        f"torch            {d['torch']} (CUDA {d['torch_cuda'] or 'none'})",
        f"triton           {d['triton']}",
        f"CUDA device      "
        + (f"{d['device']} ({d['capability']})" if d["cuda_available"] else "none visible"),
        f"library loaded   {yes(d['library_loaded'])}"
        + (f": {d['load_error']}" if d["load_error"] else f" ({d['so_path']})"),
        f"built with CUDA  {yes(d['built_with_cuda'])}",
        f"archs            {', '.join(d['archs']) or '-'}",
        f"cubins in .so    {', '.join(d['cubins']) or '-'}",
        f"PTX in .so       {', '.join(d['ptx']) or '-'}",
        f"CUDA kernels     "
        + (f"usable: this device runs {d['device_runs']}"
           + (" (JIT-compiled from PTX)" if d["device_runs"].startswith("compute_") else "")
           if d["cuda_kernels_usable"] else f"not usable: {d['cuda_kernels_why_not']}"),
        "",
        "backends",
    ]
    for row in d["backends"]:
        if row["backend"] is None and len(row["reasons"]) == 1:
            lines.append(f"  {row['op']}: {row['reasons'][0]}")
        elif row["backend"] is None:
            lines.append(f"  {row['op']}:")
            lines += [f"    {text}" for text in row["reasons"]]
        else:
            state = "usable" if not row["reasons"] else "not usable: " + "; ".join(row["reasons"])
            lines.append(f"  {row['op']} / {row['backend']}: {state}")
    lines += ["", "dispatchers (backends in the stated order)"]
    for row in d.get("dispatchers", []):
        forced = f" (forced: {row['forced']})" if row.get("forced") else ""
        lines.append(f"  {row['op']}: {', '.join(row['backends'])}{forced}")
    return "\n".join(lines)


def _cmd_info(args) -> int:
    d = info_dict()
    print(json.dumps(d, indent=2) if args.json else format_info(d))
    return 0


def _cmd_demo(args) -> int:
    return run_demo(args.demo_args)


def build_parser() -> argparse.ArgumentParser:
    parser = one_line_parser(prog="python -m mla_ext", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="per-layer KV-cache formats and pool plan for a model")
    p.add_argument("--model", default="deepseek-v3",
                   help=f"a known model ({', '.join(known_model_names())}) or a path to a HF "
                        "config.json (or its directory)")
    p.add_argument("--kv-cache-dtype", default="auto", help=f"one of: {', '.join(ALL_NAMES)}")
    p.add_argument("--skip-layers", nargs="*", default=[], metavar="ENTRY",
                   help="layer indices and/or 'sliding_window' that keep the native dtype")
    p.add_argument("--block-size", type=int_flag(1, INT32_MAX), default=16, help="tokens per block (default 16)")
    p.add_argument("--memory", type=_memory_arg, required=True,
                   help="KV-cache byte budget: 60GiB, 500MB, 123 (bytes)")
    p.add_argument("--alignment", type=int_flag(1, INT32_MAX), default=None, help="round each page up to this")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="compute per-tensor K scales on per-tensor fp8 layers")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("info", help="build facts and what can run here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("demo", help="the worked example (options: demo --help)", add_help=False)
    p.add_argument("demo_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser()
        if argv[:1] == ["demo"]:
            # The demo parses its own options (argparse's REMAINDER would reject a
            # leading option such as `demo --json`); the subparser is for --help.
            args = argparse.Namespace(func=_cmd_demo, demo_args=argv[1:])
        else:
            args = parser.parse_args(argv)
        rc = args.func(args)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not at interpreter exit
        return rc
    except ValueError as exc:
        # Bad user input: one line, exit 2, never a traceback.
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in OUTPUT_ERRNOS:
            raise
        _drop_stdout()
        print(f"error: cannot write the output: {_one_line(exc)}", file=sys.stderr)
        return 1


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's own flush at exit (of what the
    failed write left buffered) neither fails again nor prints a second error."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):  # no real stdout (e.g. captured in tests)
        pass


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
