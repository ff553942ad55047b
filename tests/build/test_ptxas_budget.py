"""Register budgets and spills of the kernels, from ptxas's own report, without a GPU.

CUDA: every csrc/**/*.cu is compiled for sm_86 and sm_90a with `-Xptxas -v`
(the flags of setup.py) and ptxas's report is parsed. A kernel states its
budget as a comment on the line right before its definition, in exactly this
form (between a `template <...>` line and the `__global__` line, or above either):

    // register budget: 64

The test fails on any spill (spill stores or loads, any function, either
arch), on a kernel using more registers than its stated budget, and on a
budget comment that no compiled kernel answers to. Kernels without a stated
budget fail only on spills; they are listed (a warning and the report).
ptxas names kernels by their mangled names: they are demangled with c++filt
when it exists, else matched by the Itanium length-prefixed base name.

Triton: every kernel is compiled ahead of time (no GPU) for sm_86 and/or sm_90
with its launch configs, and Triton's PTX goes through the same ptxas report:
kv_b_proj W4A16 old and new, the 1x128 quantizer and the row-wise gather from
explicit signatures; every other kernel (block-FP8 GEMM on sm_90, paged gather, attention in
bf16 and fp32, merge, latent attention, cache writer, KV scale) in every config its
wrapper picks on sm_86 / sm_90, from the launches tests/build/triton_specialization_probe.py
records (the signature and specialization a GPU run compiles: the attention kernel
compiled from a hand-written signature, without the launch's 16-divisibility
facts and with int64 strides, spilled 216-920 B where the real launch spills none). A Triton kernel's budget is
`# register budget: N` on the line before its `@triton.jit`.

Run time: the nvcc compiles run in parallel (as many as there are cores, at
most 4) and every ptxas report is cached under build/ptxas_budget/, keyed by
the content of the source and every csrc header, the flags and the compiler
version: an unchanged tree takes seconds. The report of the last run is in
build/ptxas_budget/report.txt.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
from helpers.ptxas import CACHE, _cached, _tool_version, _triton_ptxas, parse_ptxas, ptxas_report_ptx  # noqa: E402,F401
ARCHS = ("86", "90a")
# setup.py's nvcc flags (the ones that change code generation), one compile for both arches.
NVCC_FLAGS = ["-std=c++20", "-O3", "--expt-relaxed-constexpr", "-lineinfo", "-DMLA_EXT_WITH_CUDA",
              '-DMLA_EXT_CUDA_ARCH_LIST="8.6;9.0a"', "-U__CUDA_NO_HALF_OPERATORS__",
              "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
              f"-I{CSRC}"] + [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS] + ["-Xptxas", "-v"]
BUDGET_CU = re.compile(r"^\s*// register budget: (\d+)\s*$")
BUDGET_PY = re.compile(r"^\s*# register budget: (\d+)\s*$")
WORKERS = max(1, min(4, os.cpu_count() or 1))

# Spills allowed as a ratchet: kernel -> (bytes, why), each may spill at most the
# bytes (max of stored, loaded) recorded, on any arch and config compiled here; more
# fails, and so does an entry whose kernel no longer spills. Empty: the budget is zero
# spills for every CUDA and Triton kernel (the attention forward and the block-FP8 GEMM,
# once listed here, spill nothing when compiled as their launches compile them).
SPILL_EXEMPT: dict[str, tuple[int, str]] = {}


# -- ptxas report ------------------------------------------------------------------


def demangle(names: list[str]) -> dict[str, str]:
    """mangled -> demangled (c++filt), or {} when c++filt is missing."""
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {}
    r = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True)
    return dict(zip(names, r.stdout.splitlines()))


def base_name(mangled: str, demangled: str | None, known: set[str]) -> str:
    """The unqualified function name of a ptxas function name."""
    if demangled and demangled != mangled:
        d = demangled.replace("(anonymous namespace)", "anon")
        d = d[5:] if d.startswith("void ") else d
        cut = min([i for i in (d.find("<"), d.find("(")) if i >= 0], default=len(d))
        return d[:cut].split("::")[-1]
    for name in sorted(known, key=len, reverse=True):  # no c++filt: Itanium <length><name>
        if mangled == name or f"{len(name)}{name}" in mangled:
            return name
    return mangled


# -- budgets stated in the sources ------------------------------------------------------

def _kernel_name_after(lines: list[str], i: int) -> str | None:
    """Name of the __global__ function whose definition starts on line i."""
    text = " ".join(lines[i:i + 3])
    text = re.sub(r"__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)", "", text)
    m = re.search(r"__global__\s+(?:[\w:<>,\s*&]+?\s+)?(\w+)\s*\(", text)
    return m.group(1) if m else None


def cu_budgets(files) -> tuple[dict[str, int], list[str], set[str]]:
    """({kernel: budget}, [problems], {every __global__ name}) from the CUDA sources."""
    budgets, problems, names = {}, [], set()
    for path in files:
        lines = path.read_text().splitlines()
        attached = set()
        for i, line in enumerate(lines):
            if "__global__" not in line or line.lstrip().startswith("//"):
                continue
            name = _kernel_name_after(lines, i)
            if name is None:
                continue
            names.add(name)
            for j in (i - 1, i - 2):  # right above, or above a template line right above
                if j < 0:
                    break
                m = BUDGET_CU.match(lines[j])
                if m:
                    attached.add(j)
                    b = int(m.group(1))
                    if budgets.get(name, b) != b:
                        problems.append(f"{name}: two different budgets ({budgets[name]} and {b})")
                    budgets[name] = b
                    break
                if not lines[j].lstrip().startswith("template"):
                    break
        for j, line in enumerate(lines):
            if BUDGET_CU.match(line) and j not in attached:
                problems.append(f"{path.relative_to(ROOT)}:{j + 1}: a register budget not right before a kernel")
    return budgets, problems, names


def py_budgets(path: pathlib.Path) -> dict[str, int]:
    """{function: budget} from `# register budget: N` right before @triton.jit (or the def)."""
    lines = path.read_text().splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*def (\w+)\s*\(", line)
        if not m:
            continue
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("@"):
            j -= 1
        for k in (i - 1, j):
            if k >= 0 and BUDGET_PY.match(lines[k]):
                out[m.group(1)] = int(BUDGET_PY.match(lines[k]).group(1))
    return out


# -- compiling, with a content-hash cache ------------------------------------------------


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(CSRC.rglob("*")):
        if p.suffix in (".h", ".cuh", ".hpp", ".inc") and p.is_file():
            h.update(str(p.relative_to(CSRC)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def ptxas_report_cu(cu: pathlib.Path, nvcc: str, digest: str) -> str:
    key = "\n".join([_tool_version(nvcc), " ".join(NVCC_FLAGS), digest, cu.read_text()])

    def produce():
        r = subprocess.run([nvcc, *NVCC_FLAGS, "-c", str(cu), "-o", os.devnull], capture_output=True,
                           text=True, cwd=ROOT)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed on {cu.relative_to(ROOT)}:\n{r.stderr[-3000:]}")
        return r.stderr + r.stdout

    return _cached(key, cu.stem, produce)


def check(records: list[dict], budgets: dict[str, int], names: set[str], exempt: dict[str, str]):
    """(failures, lines of the report, kernels without a budget)."""
    demangled = demangle(sorted({r["function"] for r in records}))
    failures, lines, unbudgeted, seen, spilled_exempt = [], [], set(), set(), set()
    for r in sorted(records, key=lambda r: (r["function"], r["arch"])):
        name = base_name(r["function"], demangled.get(r["function"]), names | set(budgets))
        seen.add(name)
        budget = budgets.get(name)
        spill = r["spill_stores"] + r["spill_loads"]
        tag = ""
        worst = max(r["spill_stores"], r["spill_loads"])
        if spill and name in exempt and worst <= exempt[name][0]:
            tag = f"  SPILLS (ratchet {exempt[name][0]} B): {exempt[name][1]}"
            spilled_exempt.add(name)
        elif spill:
            failures.append(f"{name} [{r['arch']}]: spills ({r['spill_stores']} B stored, {r['spill_loads']} B "
                            f"loaded, {r['stack']} B stack) - {r['function']}")
        if r["entry"] and budget is not None and r["regs"] > budget:
            failures.append(f"{name} [{r['arch']}]: {r['regs']} registers > budget {budget} - {r['function']}")
        if r["entry"] and budget is None:
            unbudgeted.add(name)
        if r["entry"] or spill:
            lines.append(f"{r['arch']:7s} {r['regs']:4d} regs (budget {budget if budget is not None else '-':>3}) "
                         f"spill {r['spill_stores']}/{r['spill_loads']} B  {name}"
                         + ("" if demangled.get(r["function"]) is None else
                            f"  {demangled[r['function']][:150]}") + tag)
    for name in sorted(set(budgets) - seen):
        failures.append(f"{name}: a register budget is stated but no compiled kernel has that name")
    for name in sorted((set(exempt) & seen) - spilled_exempt):
        failures.append(f"{name}: no longer spills; delete its SPILL_EXEMPT entry")
    return failures, lines, sorted(unbudgeted)


def _write_report(name: str, lines: list[str]) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / name).write_text("\n".join(lines) + "\n")


# -- CUDA ---------------------------------------------------------------------------------

def test_cuda_kernels_stay_in_their_register_budgets_without_spills():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    cus = sorted(CSRC.rglob("*.cu"))
    assert cus, "no csrc/**/*.cu"
    sources = cus + sorted(p for p in CSRC.rglob("*") if p.suffix in (".cuh", ".h"))
    budgets, problems, names = cu_budgets(sources)
    digest = _headers_digest()
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        reports = list(pool.map(lambda cu: ptxas_report_cu(cu, nvcc, digest), cus))
    records = [r for text in reports for r in parse_ptxas(text)]
    archs = {r["arch"] for r in records}
    assert archs == {f"sm_{a}" for a in ARCHS}, f"ptxas reported for {archs}"
    failures, lines, unbudgeted = check(records, budgets, names, SPILL_EXEMPT)
    lines = [f"CUDA kernels ({len(cus)} files, sm_86 and sm_90a):"] + lines
    if unbudgeted:
        lines.append("kernels without a stated budget (spills checked only): " + ", ".join(unbudgeted))
        warnings.warn("CUDA kernels without a register budget: " + ", ".join(unbudgeted))
    _write_report("report.txt", lines)
    print("\n".join(lines))
    assert not problems + failures, "\n".join(problems + failures)


def test_budget_parsing_and_name_matching():
    """The parser on ptxas's format and the budget comment rules (no compiler needed)."""
    text = """ptxas info    : Compiling entry function '_ZN7mla_ext3abc8k_kernelIiEEvv' for 'sm_86'
ptxas info    : Function properties for _ZN7mla_ext3abc8k_kernelIiEEvv
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 130 registers, used 1 barriers
ptxas info    : Function properties for _ZN7mla_ext6helperEv
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'plain_kernel' for 'sm_90a'
ptxas info    : Function properties for plain_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
"""
    recs = {(r["function"], r["arch"]): r for r in parse_ptxas(text)}
    k = recs[("_ZN7mla_ext3abc8k_kernelIiEEvv", "sm_86")]
    assert (k["regs"], k["spill_stores"], k["spill_loads"], k["entry"]) == (130, 4, 12, True)
    assert recs[("plain_kernel", "sm_90a")]["regs"] == 40
    assert not recs[("_ZN7mla_ext6helperEv", "sm_86")]["entry"]
    assert base_name("_ZN7mla_ext3abc8k_kernelIiEEvv", None, {"k_kernel", "kernel"}) == "k_kernel"
    assert base_name("x", "void mla_ext::(anonymous namespace)::k_kernel<int>(int)", set()) == "k_kernel"
    assert base_name("x", "mla_ext::(anonymous namespace)::w_kernel(mla_ext::P)", set()) == "w_kernel"
    failures, _, unbudgeted = check(list(recs.values()), {"k_kernel": 128, "gone_kernel": 8},
                                    {"k_kernel", "plain_kernel"}, {})
    assert any("spills" in f and "k_kernel" in f for f in failures)
    assert any("130 registers > budget 128" in f for f in failures)
    assert any("gone_kernel" in f for f in failures)
    assert unbudgeted == ["plain_kernel"]
    # The spill ratchet: up to the recorded bytes passes, more fails, none asks for the entry's removal.
    recs2 = [dict(r) for r in recs.values()]
    assert not [f for f in check(recs2, {}, {"k_kernel"}, {"k_kernel": (12, "why")})[0] if "spills" in f]
    assert [f for f in check(recs2, {}, {"k_kernel"}, {"k_kernel": (11, "why")})[0] if "spills" in f]
    assert any("no longer spills" in f for f in check(recs2, {}, set(), {"plain_kernel": (8, "why")})[0])


def test_budget_comments_attach_to_the_next_kernel(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text("\n".join([
        "template <int N>",
        "// register budget: 64",
        "__global__ void __launch_bounds__(f(1, 2), 4) a_kernel(P p) {}",
        "// register budget: 32",
        "template <class T, int N>",
        "__global__ void b_kernel(",
        "    P p) {}",
        "// register budget: 16",
        "__global__ void c_kernel(P p) {}",
        "__global__ void d_kernel(P p) {}",
        "// register budget: 8",
        "",
        "__global__ void e_kernel(P p) {}",
        "// register budget 12",
    ]))
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        budgets, problems, names = cu_budgets([src])
    finally:
        ROOT = old
    assert budgets == {"a_kernel": 64, "b_kernel": 32, "c_kernel": 16}
    assert names == {"a_kernel", "b_kernel", "c_kernel", "d_kernel", "e_kernel"}
    assert len(problems) == 1 and "k.cu:11" in problems[0]


# -- Triton ---------------------------------------------------------------------------------

_TRITON_SCRIPT = r"""
import json, sys
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import sm_arch_from_capability

def build(fn, sig, consts, cc, options=None, div16=()):
    params = list(sig)
    s = dict(sig, **{k: "constexpr" for k in consts})
    attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in div16}
    k = triton.compile(ASTSource(fn=fn, signature=s, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", cc, 32), options=dict(options or {}))
    print(json.dumps(dict(kernel=fn.__name__, module=fn.fn.__module__ if hasattr(fn, "fn") else fn.__module__,
                          arch=sm_arch_from_capability(cc), config=repr(sorted(consts.items())) + repr(options),
                          ptx=k.asm["ptx"])))

def split(cfg):
    cfg = dict(cfg)
    return cfg, {"num_warps": cfg.pop("num_warps", 4), "num_stages": cfg.pop("num_stages", 3)}

import torch
from mla_ext.kv_b_proj import quant, triton_w4a16 as w4
i32 = "i32"
w4_sig = dict(a_ptr="*bf16", b_ptr="*u8", s_ptr="*u8", g_ptr="*fp32", c_ptr="*bf16", M=i32, N=i32, K=i32,
              stride_am=i32, stride_bn=i32, stride_sn=i32, stride_cm=i32)
w4_div = ["a_ptr", "b_ptr", "s_ptr", "c_ptr", "K", "stride_am", "stride_bn", "stride_sn", "stride_cm"]
for cc in (86, 90):
    for m, n, sms in ((1, 4096, 132), (1, 32768, 132), (32, 4096, 132), (64, 4096, 132), (4096, 4096, 132)):
        cfg, opts = split(dict(w4._config(m, n, sms), EVEN_K=True))  # K = 512
        build(w4._w4a16_kernel, w4_sig, cfg, cc, opts, w4_div)

q_sig = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", M=i32, K=i32, Mq=i32, Kq=i32, stride_xm=i32,
             stride_qm=i32, stride_sm=i32, stride_sg=i32, eps="fp32")
build(quant._quant_kernel, q_sig, dict(GROUP=quant.GROUP, BLOCK_M=16, FP8_OUT=True), 90)

# Every other kernel, in every config its wrapper picks on sm_86 / sm_90 (attention in
# bf16 and fp32, causal or not, 192/128- and 256/256-wide heads; the paged gather, merge,
# latent attention, the cache writer and KV scale), compiled
# from the launches tests/build/triton_specialization_probe.py records (nothing runs): the
# signature and specialization a GPU run would compile.
sys.path.insert(0, "tests/build")  # the probe (cwd: the repository root)
import triton_specialization_probe as probe
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
COVERED = {"_w4a16_kernel", "_group_quant_kernel"}
FP8_ONLY = {"_fp8_block_gemm_kernel"}  # dispatched to sm_89+ only (Triton has no fp8 type on sm_86)
for cc in (86, 90):
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    seen = set()
    for fn, args, kwargs in probe.record_launches(cc):
        if fn.__name__ in COVERED or (fn.__name__ in FP8_ONLY and cc < 89):
            continue
        bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
        key = (fn.__name__, repr(spec), repr(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        opts, signature, constexprs, attrs = fn._pack_args(backend, dict(options), bound, spec, options)
        k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts.__dict__)
        consts = sorted((p.name, bound[p.name]) for p in fn.params if p.is_constexpr)
        print(json.dumps(dict(kernel=fn.__name__, module=fn.fn.__module__, arch=sm_arch_from_capability(cc),
                              config=repr(consts) + repr(sorted(options.items())), ptx=k.asm["ptx"])))
print("TRITON-DONE")
"""


def triton36_folder() -> pathlib.Path:
    """The lent GPU machine's Triton (3.6) beside the pinned one: MLA_EXT_TRITON36=<folder>,
    else build/triton36 when present, else the client cache's target folder, filled on
    first use (tests/clients/client_tree.py: pip install --no-deps --target); the
    test is skipped, with pip's reason, when it cannot be filled."""
    given = os.environ.get("MLA_EXT_TRITON36")
    if given:
        return pathlib.Path(given)
    if (ROOT / "build" / "triton36" / "triton").is_dir():
        return ROOT / "build" / "triton36"
    from clients.client_tree import ClientUnavailable, ensure_target

    try:
        return ensure_target("triton36")
    except ClientUnavailable as exc:
        pytest.skip(f"no Triton 3.6: {exc}")


@pytest.mark.parametrize("which", ["pinned", "3.6"])
def test_triton_kernels_stay_in_their_register_budgets_without_spills(which):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if which == "pinned":
        ptxas = _triton_ptxas()
    else:
        folder = triton36_folder()
        ptxas = folder / "triton" / "backends" / "nvidia" / "bin" / "ptxas"
        if not ptxas.exists():
            pytest.skip(f"no ptxas in the Triton 3.6 at {folder}")
        ptxas = str(ptxas)
        env["PYTHONPATH"] = os.pathsep.join([str(folder)] + [p for p in [env.get("PYTHONPATH")] if p])
    if ptxas is None:
        pytest.skip("no ptxas for Triton")
    r = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert r.returncode == 0 and "TRITON-DONE" in r.stdout, r.stderr[-3000:]
    compiled = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    version = _tool_version(ptxas)
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        reports = list(pool.map(lambda c: ptxas_report_ptx(c["ptx"], c["arch"], ptxas, version), compiled))
    budgets = {}
    for mod in sorted({c["module"] for c in compiled}):
        path = ROOT / (mod.replace(".", "/") + ".py")
        if path.exists():
            budgets.update({k: v for k, v in py_budgets(path).items()
                            if k in {c["kernel"] for c in compiled if c["module"] == mod}})
    records, lines = [], []
    for c, text in zip(compiled, reports):
        for rec in parse_ptxas(text):
            rec = dict(rec, function=c["kernel"])  # Triton names the entry after the Python function
            records.append(rec)
            lines.append(f"{rec['arch']:7s} {rec['regs']:4d} regs spill {rec['spill_stores']}/{rec['spill_loads']} B  "
                         f"{c['kernel']} {c['config']}")
    failures, _, unbudgeted = check(records, budgets, {c["kernel"] for c in compiled}, SPILL_EXEMPT)
    lines = [f"Triton {which} kernels ({len(compiled)} compiles):"] + lines
    lines.append("budgets stated: " + (", ".join(f"{k} {v}" for k, v in sorted(budgets.items())) or "none"))
    if unbudgeted:
        lines.append("kernels without a stated budget (spills checked only): " + ", ".join(unbudgeted))
    exempt = sorted(k for k in SPILL_EXEMPT if any(c["kernel"] == k for c in compiled))
    lines += [f"spill ratchet: {k} <= {SPILL_EXEMPT[k][0]} B: {SPILL_EXEMPT[k][1]}" for k in exempt]
    _write_report("report_triton.txt" if which == "pinned" else f"report_triton_{which}.txt", lines)
    print("\n".join(lines))
    assert not failures, "\n".join(failures)
