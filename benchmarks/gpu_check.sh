#!/usr/bin/env bash
# One-shot check for a lent GPU machine (torch, triton, nvcc, ninja preinstalled;
# no network):
#   benchmarks/gpu_check.sh OUTDIR
# 1. builds the extension against the machine's own torch for the local GPU arch,
# 2. prints build facts (python -m mla_ext info),
# 3. runs the CUDA-marked tests,
# 4. runs the compiled kernels' CUDA tests under compute-sanitizer memcheck,
# 5. runs `python -m mla_ext demo --full` and every benchmarks/bench_*.py at quick sizes,
# and writes logs plus summary.md (a table of steps, status and seconds) to
# OUTDIR. Each step has its own time limit so the whole run fits in 8 minutes.
set -u
out="${1:?usage: benchmarks/gpu_check.sh OUTDIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
summary="$out/summary.md"
start_all=$(date +%s)
echo "| step | status | seconds | log |" > "$summary"
echo "|---|---|---|---|" >> "$summary"

step() {  # step NAME LIMIT_S CMD...
  local name="$1" limit="$2"; shift 2
  local log="$out/$name.log" t0 rc
  t0=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout --signal=KILL "$limit" "$@" > "$log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local status="ok"; [ $rc -ne 0 ] && status="FAIL (rc=$rc)"; [ $rc -eq 137 ] && status="TIMEOUT"
  echo "| $name | $status | $dt | $name.log |" >> "$summary"
  tail -n 15 "$log"
  return $rc
}

# Facts about the machine.
{ nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv 2>&1
  "$py" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  nvcc --version 2>&1 | tail -2; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

# Without a visible GPU (a dry run on a build machine) the script still builds
# the CUDA kernels for the default arches and runs every CPU-side step; the
# GPU-only steps are listed as skipped in the summary.
if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  gpu=1
  arch="$("$py" -c 'import torch; M,m=torch.cuda.get_device_capability(); print(f"{M}.{m}" + ("a" if M==9 else ""))')"
else
  gpu=0
  arch="${TORCH_CUDA_ARCH_LIST:-8.6;9.0a}"
  echo "no CUDA device visible: CPU-side steps only"
fi
export TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="${MAX_JOBS:-16}" MLA_EXT_CUDA=1
skipped() { echo "| $1 | SKIPPED ($2) | 0 | |" >> "$summary"; }

step build 300 "$py" -m pip install -e . --no-build-isolation --no-deps -v
built=$?
if [ $built -eq 0 ]; then
  step info 60 "$py" -m mla_ext info
  if [ $gpu -eq 1 ]; then
    step cuda_tests 240 "$py" -m pytest -q -m cuda tests -p no:cacheprovider
    # Memory checking of the compiled kernels (not Triton's JIT): every CUDA
    # test of the C++/CUDA ops under compute-sanitizer memcheck.
    san="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
    if [ -x "$san" ]; then
      step memcheck 150 "$san" --tool memcheck --error-exitcode 99 --target-processes all \
        "$py" -m pytest -q -x -m cuda -p no:cacheprovider \
        tests/test_cache_ops.py tests/test_attention_merge.py tests/test_kv_b_proj_marlin.py
    else
      skipped memcheck "no compute-sanitizer"
    fi
    # The main job at full size (DeepSeek-V3 TP8 shapes), checked against the oracle.
    step demo 150 "$py" -m mla_ext demo --full
  else
    skipped cuda_tests "no GPU"
    skipped memcheck "no GPU"
    step demo 150 "$py" -m mla_ext demo
  fi
  for b in benchmarks/bench_*.py; do
    [ -e "$b" ] || continue
    name="bench_$(basename "$b" .py | sed 's/^bench_//')"
    step "$name" 90 "$py" "$b" --quick --out "$out"
  done
fi
echo "| total | | $(( $(date +%s) - start_all )) | |" >> "$summary"
echo; cat "$summary"
