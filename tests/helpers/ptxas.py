"""ptxas: run it (cached by the input's hash under build/ptxas_budget) and parse its register,
spill and shared-memory report; shared by the CUDA (build/test_ptxas_budget.py) and Triton AOT
(*/test_*_aot.py) budget tests."""
from __future__ import annotations

import hashlib
import os
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "ptxas_budget"


def parse_ptxas(text: str) -> list[dict]:
    """ptxas -v output -> [{function, arch, entry, regs, spill_stores, spill_loads, stack}].

    Entry functions come from 'Compiling entry function', their registers from
    the 'Used N registers' line that follows; every 'Function properties for X'
    (entries and non-inlined device functions) gives X's stack and spills."""
    out: dict[tuple[str, str], dict] = {}
    arch = None
    entry = None
    props = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if m:
            entry, arch = m.group(1), m.group(2)
            out.setdefault((entry, arch), dict(function=entry, arch=arch, entry=True, regs=0, spill_stores=0,
                                               spill_loads=0, stack=0))
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and props is not None:
            rec = out.setdefault((props, arch), dict(function=props, arch=arch, entry=False, regs=0,
                                                     spill_stores=0, spill_loads=0, stack=0))
            rec.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            props = None
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            out[(entry, arch)]["regs"] = int(m.group(1))
    return list(out.values())


def _tool_version(tool: str) -> str:
    return subprocess.run([tool, "--version"], capture_output=True, text=True).stdout


def _triton_ptxas() -> str | None:
    try:
        from triton import knobs

        return knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001 - older Triton: its bundled binary
        import triton

        p = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        return str(p) if p.exists() else shutil.which("ptxas")


def ptxas_report_ptx(ptx: str, arch: str, ptxas: str, version: str) -> str:
    """ptxas -v on Triton's PTX with Triton's own flags (-lineinfo, --regAllocOptLevel=2)."""
    key = "\n".join([version, arch, ptx])
    name = re.search(r"\.entry\s+(\w+)", ptx)

    def produce():
        d = CACHE / "tmp"
        d.mkdir(parents=True, exist_ok=True)
        src = d / f"{os.getpid()}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.ptx"
        src.write_text(ptx)
        try:
            cmd = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src), "-o", os.devnull]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0 and "regAllocOptLevel" in r.stderr:
                cmd.remove("--regAllocOptLevel=2")
                r = subprocess.run(cmd, capture_output=True, text=True)
        finally:
            src.unlink(missing_ok=True)
        if r.returncode != 0:
            raise RuntimeError(f"ptxas failed on {name.group(1) if name else '?'} ({arch}):\n{r.stderr[-2000:]}")
        return r.stderr + r.stdout

    return _cached(key, f"triton-{name.group(1) if name else 'kernel'}-{arch}", produce)


def _cached(key: str, stem: str, produce) -> str:
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.log"
    if path.exists():
        return path.read_text()
    text = produce()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return text
