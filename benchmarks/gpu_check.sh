#!/usr/bin/env bash
# One command for a lent GPU machine (SPEC §11: one command <= 600 s, at most 8
# files come back from the output folder, none deeper than OUTDIR/a/b, 16 MB each):
#
#   benchmarks/gpu_check.sh OUTDIR        run (a CPU-side dry run without a GPU)
#   benchmarks/gpu_check.sh --plan [gpu|cpu]
#                                         print the plan only: the steps, their caps,
#                                         a worst-case timeline and the files OUTDIR
#                                         holds after each step (GPU_CHECK_PLAN_ONLY=1
#                                         does the same; GPU_CHECK_PLAN_ASSUME=zero
#                                         lets every planned step take 0 s instead of
#                                         its whole cap)
#
# Steps, in order of value (each runs under `timeout -s INT -k 10`, so pytest and
# the benchmarks print what they have before they stop):
#   facts       GPU (nvidia-smi), driver, python/torch/triton/numpy/setuptools/pip
#               versions, which ninja/nvcc/compute-sanitizer/ncu
#   build       pip install -e . (no index, no build isolation), or
#               setup.py build_ext --inplace when pip is missing or fails
#   info        python -m mla_ext info
#   cuda        pytest -m cuda, one process per test file (a sticky CUDA fault or a
#               hang costs one file), GPU_CHECK_JOBS files at a time (default 4),
#               faulthandler timeout, junit XML
#   memcheck    compute-sanitizer memcheck of the C++/CUDA ops' tests (not Triton),
#               one process per file, in parallel, caching allocator off,
#               HYPOTHESIS_PROFILE=memcheck (a few examples per property test)
#   racecheck   compute-sanitizer racecheck of one split-K Marlin v2 GEMM and one
#               paged-gather call (benchmarks/racecheck_calls.py): the shared-memory
#               hazards memcheck does not look for
#   demo        python -m mla_ext demo --full, checked against the oracle
#   bench_kv_b_proj  --sweep: the dispatch thresholds' crossovers, M >= 8K vs bf16, and
#               the measured dispatch table bench/dispatch_table_<device>.json (in the
#               tarball only; copy it to mla_ext/dispatch_tables/<device>.json to commit it)
#   bench_prefill; bench_absorbed (--quick: context attention up-projected vs in latent
#               space, fp8_ds_mla, T x C sweep: the measured crossover beside the cost model's,
#               in its log tail; CSV, report and the measured rates in the tarball only,
#               bench/dispatch_table_<device>.json gets a context_attention section)
#   bench_cache (10 repetitions), bench_attention
#   bench_vllm_sparse  vLLM's DSA path on mla_ext's plugin ops (benchmarks/bench_vllm_sparse.py
#               --quick): the sparse MLA backend's attention from physical top-k slots (decode,
#               CUDA-graph captured and replayed, and prefill past index_topk; bf16 and fp8_ds_mla)
#               and the indexer ops with DeepGEMM's contracts, each checked against the torch
#               reference and timed vs a device copy / the roofline; CSV in the tarball only
#   bench_sparse (--quick: DSA sparse prefill vs dense at 32K and 128K context, fp8_ds_mla
#               + fp8 index cache, bytes/FLOPs vs the roofline; CSV in the tarball only)
# Without a GPU (no nvidia-smi, or it lists none) it runs the CPU-side steps (build,
# info, demo, benchmarks at CPU sizes). If nvidia-smi lists a GPU and torch cannot
# initialise CUDA it stops at once with torch's error: no silent CPU run.
#
# Time: a global deadline (GPU_CHECK_DEADLINE, default 540 s from the start). A
# step gets min(its cap, its group's cap left, deadline - MARGIN - elapsed) and is
# skipped, with a note, when that is below its minimum. A parallel group gets
# min(group cap, deadline - MARGIN - elapsed) as a whole; each of its files
# min(file cap, what is left of that). MARGIN covers the kill grace and the
# re-packing after a step, so the whole run ends by the deadline.
#
# Files: everything is written to a work folder outside OUTDIR (GPU_CHECK_WORK, or
# a new folder under $TMPDIR); after every step the script re-packs it into
# OUTDIR/gpu_check.tar.gz and copies the few files worth reading at once
# (summary.md, the kv_b_proj crossovers, the benchmark CSVs) flat into OUTDIR:
# at most 7 files there at any time (+1 while one is being replaced). Logs are
# capped (head + tail). GPU_CHECK_ONLY=facts,info,... runs only the named steps.
set -u

# -- configuration (the plan test, tests/build/test_gpu_check_harness.py, checks these) --
DEADLINE="${GPU_CHECK_DEADLINE:-540}"
KILL_GRACE=5                   # timeout -k: SIGKILL this long after SIGINT (pytest stops in ~1 s)
PACK_S=3                       # allowance for re-packing and publishing after a step (< 1 s measured)
MARGIN=$((KILL_GRACE + PACK_S))
LOG_CAP=262144                 # bytes kept of a log: 64 KiB head + the tail
FAULTHANDLER_S=45              # pytest dumps every thread's stack after this long in one test
# group  cap  (the cuda and memcheck groups run one step per test file). The caps
# are budgets, not guesses: their sum plus each step's kill grace and packing fits
# the default deadline, so even when every step runs to its cap, every step runs
# (tests/build/test_gpu_check_harness.py checks it). Benchmarks write rows as they go, so
# a capped one still returns what it measured. bench_absorbed's 20 s (+ its 8 s of
# kill grace and packing) came out of build 4, memcheck 4, demo 4, kv_b_proj 8,
# gather 3 and attention 3. bench_sparse's 15 s (+ 8) came out of facts 4, cuda 5,
# memcheck 4, demo 4 and kv_b_proj 6. racecheck's 18 s (+ 8 s of kill grace and
# packing) came out of build 16 (one arch, no PTX on the lent machine), cuda 6 and
# kv_b_proj 4. bench_vllm_sparse's 14 s (+ 8) came out of cuda 9, demo 4, kv_b_proj 6
# and absorbed 3.
CAP_FACTS=11; CAP_BUILD=120; CAP_INFO=15
CAP_CUDA=75; CAP_CUDA_FILE=75
CAP_MEMCHECK=42; CAP_MEMCHECK_FILE=42
CAP_RACECHECK=18
CAP_DEMO=23; CAP_KVB=26; CAP_PREFILL=20; CAP_ABSORBED=17; CAP_GATHER=12; CAP_ATTENTION=12; CAP_SPARSE=15
CAP_VLLM_SPARSE=14
# Test files of the C++/CUDA ops, for memcheck (their Triton cases are deselected).
MEMCHECK_FILES="cache/test_cache_ops.py cache/test_cache_fp8.py attention/test_attention_merge.py kv_b_proj/test_kv_b_proj_marlin.py"
# CUDA test files run first in this order; any other file with a cuda mark follows.
CUDA_FIRST="cache/test_cache_ops.py cache/test_cache_fp8.py attention/test_attention_merge.py kv_b_proj/test_kv_b_proj_marlin.py prefill/test_prefill_cuda.py"
# What OUTDIR receives: producing group | path under the work folder (glob) | name in OUTDIR.
PUBLISH=(
  "always|summary.md|summary.md"
  "bench_kv_b_proj|bench/kv_b_proj_crossovers_*.txt|kv_b_proj_crossovers.txt"
  "bench_kv_b_proj|bench/kv_b_proj_*.csv|kv_b_proj.csv"
  "bench_prefill|bench/prefill_*.csv|prefill.csv"
  "bench_cache|bench/gather_*.csv|gather.csv"
  "bench_attention|bench/bench_attention_*.csv|attention.csv"
)
TARBALL=gpu_check.tar.gz
MAX_TAR_BYTES=$((15 * 1024 * 1024))

# -- arguments -------------------------------------------------------------------
plan=0; mode=""
if [ "${1:-}" = "--plan" ]; then
  plan=1; mode="${2:-gpu}"; out="OUTDIR"
elif [ "${GPU_CHECK_PLAN_ONLY:-0}" = "1" ]; then
  plan=1; mode="${GPU_CHECK_PLAN_MODE:-gpu}"; out="${1:-OUTDIR}"
else
  out="${1:?usage: benchmarks/gpu_check.sh OUTDIR | --plan [gpu|cpu]}"
fi
case "$mode" in ""|gpu|cpu) ;; *) echo "--plan takes gpu or cpu, got '$mode'" >&2; exit 2 ;; esac
assume="${GPU_CHECK_PLAN_ASSUME:-cap}"
only=",${GPU_CHECK_ONLY:-},"

cd "$(dirname "$0")/.."
repo="$(pwd)"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ -x .venv/bin/python ]; then py="$repo/.venv/bin/python"
else py="python3"; fi
T0=$(date +%s)
SIM=0                          # the plan's simulated clock
elapsed() { if [ $plan -eq 1 ]; then echo $SIM; else echo $(( $(date +%s) - T0 )); fi; }

if [ $plan -eq 0 ]; then
  mkdir -p "$out" && out="$(cd "$out" && pwd)" || { echo "cannot create $out" >&2; exit 2; }
  base="${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}"
  work="$base/gpu_check"
  mkdir -p "$work/logs" "$work/junit" "$work/bench"
  : > "$work/steps.tsv"
  echo "gpu_check: work folder $work, OUTDIR $out, deadline ${DEADLINE}s"
  # The interpreter's own bin dirs first: its ninja, pip, cmake.
  pybin="$("$py" -c 'import os, sys, sysconfig; print(os.path.dirname(sys.executable) + ":" + sysconfig.get_path("scripts"))' 2>/dev/null)"
  export PATH="${pybin:+$pybin:}$PATH"
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
  export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONUNBUFFERED=1
  export MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)}"
else
  echo "PLAN mode=$mode deadline=$DEADLINE margin=$MARGIN kill_grace=$KILL_GRACE pack=$PACK_S assume=$assume" \
       "max_out_files=8 transient=1"
fi
done_groups=" always "
failures=0

# -- bookkeeping -----------------------------------------------------------------
record() {  # NAME STATUS SECONDS LIMIT NOTE
  [ $plan -eq 1 ] && return 0
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$work/steps.tsv"
}

cap_log() {  # keep the head and the tail of a long log
  local f="$1" size
  size=$(stat -c %s "$f" 2>/dev/null || echo 0)
  [ "$size" -le $LOG_CAP ] && return 0
  { head -c 65536 "$f"; printf '\n\n[... %d bytes cut by gpu_check.sh ...]\n\n' $((size - LOG_CAP));
    tail -c $((LOG_CAP - 65536)) "$f"; } > "$f.cut" && mv "$f.cut" "$f"
}

make_summary() {
  local s="$work/summary.md"
  { echo "# gpu_check $(date -u +%FT%TZ)"
    echo
    echo "mode: ${mode}; deadline ${DEADLINE}s; elapsed $(elapsed)s; python: $py; work folder: $work"
    echo "everything (logs, junit XML, CSVs, plots): $TARBALL"
    echo
    echo "| step | status | seconds | limit | note |"
    echo "|---|---|---|---|---|"
    awk -F'\t' '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5 }' "$work/steps.tsv"
    echo
    if [ -s "$work/logs/facts.log" ]; then
      echo "## Machine"; echo; echo '```'; head -n 40 "$work/logs/facts.log"; echo '```'; echo
    fi
    timeout 8 "$py" "$repo/benchmarks/gpu_check_summary.py" "$work" 2>&1 | head -c 12000
  } > "$s.new" 2>&1
  mv "$s.new" "$s"
}

publish() {  # re-pack the work folder into OUTDIR and copy the files worth reading
  local after="$1" entry grp pat name f names="" n
  if [ $plan -eq 1 ]; then
    for entry in "${PUBLISH[@]}"; do
      IFS='|' read -r grp pat name <<< "$entry"
      case "$done_groups" in *" $grp "*) names="$names,$name" ;; esac
    done
    echo "PLAN out_after=$after files=$TARBALL$names"
    return 0
  fi
  make_summary
  tar -czf "$base/$TARBALL" -C "$base" gpu_check 2>/dev/null
  if [ "$(stat -c %s "$base/$TARBALL" 2>/dev/null || echo 0)" -gt $MAX_TAR_BYTES ]; then
    echo "note: $TARBALL over $MAX_TAR_BYTES bytes; packing without plots and junit XML" >> "$work/summary.md"
    tar -czf "$base/$TARBALL" -C "$base" --exclude='*.png' --exclude='*.xml' gpu_check 2>/dev/null
  fi
  cp "$base/$TARBALL" "$out/.$TARBALL.part" && mv -f "$out/.$TARBALL.part" "$out/$TARBALL"
  for entry in "${PUBLISH[@]}"; do
    IFS='|' read -r grp pat name <<< "$entry"
    for f in $work/$pat; do
      [ -f "$f" ] || continue
      cp "$f" "$out/.$name.part" && mv -f "$out/.$name.part" "$out/$name"
      break
    done
  done
  n=$(find "$out" -type f | wc -l)
  [ "$n" -gt 8 ] && echo "WARNING: $out holds $n files (only 8 come back from a lent machine)"
  return 0
}

selected() {  # GROUP: is it in GPU_CHECK_ONLY (or is that unset)?
  [ "$only" = ",," ] || [[ "$only" == *",$1,"* ]]
}

limit_for() {  # CAP: min(CAP, deadline - MARGIN - elapsed, the group's end - elapsed)
  local t limit=$1
  t=$(elapsed)
  [ $((DEADLINE - MARGIN - t)) -lt $limit ] && limit=$((DEADLINE - MARGIN - t))
  [ $group_end -gt 0 ] && [ $((group_end - t)) -lt $limit ] && limit=$((group_end - t))
  echo $limit
}

skip_step() {  # NAME LIMIT MIN
  record "$1" "SKIPPED" 0 "$2" "only ${2}s left of the deadline/group cap; needs ${3}s"
  [ $plan -eq 0 ] && echo "== $1: SKIPPED (only ${2}s left, needs ${3}s)"
  return 0
}

finish_step() {  # NAME RC START LIMIT: record, cap the log, print a digest
  local name="$1" rc="$2" t="$3" limit="$4" log="$work/logs/$1.log" dt status note=""
  dt=$(( $(elapsed) - t ))
  case $rc in
    0) status="ok" ;;
    124) status="TIMEOUT"; note="interrupted at ${limit}s (SIGINT)" ;;
    137) status="TIMEOUT"; note="killed at $((limit + KILL_GRACE))s" ;;
    99) status="FAIL (rc=99)"; note="compute-sanitizer reported errors" ;;
    *) status="FAIL (rc=$rc)" ;;
  esac
  [ "$rc" -ne 0 ] && failures=$((failures + 1))
  cap_log "$log"
  record "$name" "$status" "$dt" "$limit" "$note"
  echo "== $name: $status in ${dt}s (limit ${limit}s); log tail:"
  tail -n "$([ "$rc" -eq 0 ] && echo 3 || echo 12)" "$log" | cut -c1-200 | sed 's/^/   | /'
}

# step NAME GROUP CAP MIN CMD...: run CMD under the deadline; 99 when skipped.
group_end=0                    # elapsed second at which the current group's cap runs out
step() {
  local name="$1" group="$2" cap="$3" min="$4"; shift 4
  done_groups="$done_groups$group "
  if ! selected "$group"; then
    record "$name" "SKIPPED" 0 0 "not in GPU_CHECK_ONLY"
    return 99
  fi
  local t limit rc
  t=$(elapsed)
  limit=$(limit_for "$cap")
  if [ $limit -lt "$min" ]; then
    [ $plan -eq 1 ] && echo "PLAN step=$name group=$group start=$t cap=$cap min=$min limit=$limit skipped=1"
    skip_step "$name" "$limit" "$min"
    publish "$name"
    return 99
  fi
  if [ $plan -eq 1 ]; then
    echo "PLAN step=$name group=$group start=$t cap=$cap min=$min limit=$limit skipped=0"
    [ "$assume" = "cap" ] && SIM=$((SIM + limit + KILL_GRACE + PACK_S))
    publish "$name"
    return 0
  fi
  echo "== $name (limit ${limit}s, ${t}s elapsed): $*"
  timeout -s INT -k $KILL_GRACE "$limit" "$@" > "$work/logs/$name.log" 2>&1 < /dev/null
  rc=$?
  finish_step "$name" $rc "$t" "$limit"
  publish "$name"
  return $rc
}

# pool GROUP GROUP_CAP FILE_CAP MIN FUNC FILES...: `FUNC FILE` for every file, one
# process each, GPU_CHECK_JOBS at a time; the group ends within min(GROUP_CAP,
# deadline - MARGIN - elapsed) plus the kill grace.
pool() {
  local group="$1" gcap="$2" fcap="$3" min="$4" func="$5"; shift 5
  local f name t limit now pid rc fl done_name
  done_groups="$done_groups$group "
  if ! selected "$group"; then
    for f in "$@"; do record "$group.$(basename "${f%.py}")" "SKIPPED" 0 0 "not in GPU_CHECK_ONLY"; done
    return 0
  fi
  t=$(elapsed)
  limit=$(limit_for "$gcap")
  if [ $plan -eq 1 ]; then
    echo "PLAN group=$group start=$t cap=$gcap limit=$limit jobs=$JOBS files=$#"
    for f in "$@"; do
      fl=$fcap; [ $limit -lt $fl ] && fl=$limit
      echo "PLAN step=$group.$(basename "${f%.py}") group=$group start=$t cap=$fcap min=$min limit=$fl" \
           "skipped=$([ $fl -lt "$min" ] && echo 1 || echo 0)"
    done
    [ "$assume" = "cap" ] && [ $limit -ge "$min" ] && SIM=$((SIM + limit + KILL_GRACE + PACK_S))
    publish "$group"
    return 0
  fi
  group_end=$((t + limit))
  local -A started=() names=() limits=()
  reap() {  # wait for one running file to end
    while :; do
      for pid in "${!started[@]}"; do
        if ! kill -0 "$pid" 2>/dev/null; then
          wait "$pid"; rc=$?
          done_name="${names[$pid]}"
          finish_step "$done_name" $rc "${started[$pid]}" "${limits[$pid]}"
          unset "started[$pid]" "names[$pid]" "limits[$pid]"
          publish "$done_name"
          return 0
        fi
      done
      sleep 1
    done
  }
  echo "== $group: $# files, $JOBS at a time, group limit ${limit}s"
  for f in "$@"; do
    name="$group.$(basename "${f%.py}")"
    while [ ${#started[@]} -ge "$JOBS" ]; do reap; done
    now=$(elapsed)
    fl=$(limit_for "$fcap")
    if [ "$fl" -lt "$min" ]; then skip_step "$name" "$fl" "$min"; continue; fi
    timeout -s INT -k $KILL_GRACE "$fl" bash -c "$func \"\$1\"" _ "$f" > "$work/logs/$name.log" 2>&1 < /dev/null &
    pid=$!
    started[$pid]=$now; names[$pid]=$name; limits[$pid]=$fl
  done
  while [ ${#started[@]} -gt 0 ]; do reap; done
  group_end=0
  publish "$group"
}

# -- the steps' commands (run under timeout, so functions are exported) ---------
facts() {
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cores: $(nproc)  memory: $(free -g 2>/dev/null | awk '/Mem:/{print $2 " GiB"}')"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>&1
    nvidia-smi 2>&1 | sed -n '3p'
  else
    echo "nvidia-smi: not found"
  fi
  "$py" - <<'EOF'
import importlib, sys, warnings
warnings.simplefilter("ignore")
print("python", sys.version.split()[0], sys.executable)
for mod in ("torch", "triton", "numpy", "setuptools", "pip", "wheel", "ninja", "pytest", "hypothesis", "matplotlib"):
    try:
        print(f"{mod} {getattr(importlib.import_module(mod), '__version__', '?')}")
    except Exception as exc:
        print(f"{mod} MISSING ({type(exc).__name__}: {exc})")
import torch
print("torch.version.cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
EOF
  local t
  for t in ninja nvcc compute-sanitizer ncu cmake; do echo "which $t: $(command -v $t || echo -)"; done
  command -v nvcc > /dev/null && nvcc --version 2>&1 | tail -n 2
  command -v compute-sanitizer > /dev/null && compute-sanitizer --version 2>&1 | head -n 2
  df -h "$repo" "${TMPDIR:-/tmp}" 2>&1 | tail -n +2 | sort -u
  return 0
}

build() {
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MLA_EXT_CUDA=$MLA_EXT_CUDA MAX_JOBS=$MAX_JOBS"
  echo "PATH=$PATH"
  if command -v flock > /dev/null; then exec 9> "$repo/.build.lock"; flock 9; fi  # as `make build`
  # An editable install needs pip and a bdist_wheel (setuptools >= 70.1, or wheel).
  if ! "$py" -m pip --version; then
    echo "== pip is missing: setup.py build_ext --inplace"
  elif ! "$py" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("setuptools.command.bdist_wheel") or u.find_spec("wheel")))'; then
    echo "== setuptools $("$py" -c 'import setuptools; print(setuptools.__version__)' 2>&1) has no bdist_wheel" \
         "and wheel is missing: setup.py build_ext --inplace"
  else
    "$py" -m pip install -e . --no-build-isolation --no-deps -v && return 0
    echo "== pip install -e . failed: setup.py build_ext --inplace"
  fi
  "$py" setup.py build_ext --inplace
}
export -f facts build
export py repo work

# One CUDA test file: its cuda-marked tests in their own process, junit XML.
cuda_file() {  # cuda_file <stage>/test_x.py (relative to tests/)
  "$py" -m pytest -q -p no:cacheprovider -o faulthandler_timeout=$FAULTHANDLER_S -rfE -m cuda \
    --junitxml="$work/junit/$(echo "${1%.py}" | tr / _).xml" "tests/$1"
  local rc=$?
  [ $rc -eq 5 ] && { echo "(no test selected)"; return 0; }
  return $rc
}
# One C++/CUDA op test file under compute-sanitizer memcheck: every allocation
# its own (no caching allocator), a few hypothesis examples, the Triton cases
# deselected; rc 99 when the sanitizer reports an error.
memcheck_file() {  # memcheck_file <stage>/test_x.py (relative to tests/)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 HYPOTHESIS_PROFILE=memcheck \
    "$san" --tool memcheck --error-exitcode 99 --report-api-errors no --print-limit 20 \
    "$py" -m pytest -q -p no:cacheprovider -o faulthandler_timeout=$FAULTHANDLER_S -rfE -m cuda \
    -k "not triton" "tests/$1"
}
# One split-K Marlin call and one paged-gather call under racecheck; rc 99 on a hazard.
racecheck_calls() {
  "$san" --tool racecheck --error-exitcode 99 --print-limit 20 "$py" benchmarks/racecheck_calls.py
}
export -f cuda_file memcheck_file racecheck_calls
export FAULTHANDLER_S
JOBS="${GPU_CHECK_JOBS:-$(n=$(( $(nproc 2>/dev/null || echo 4) / 4 )); [ $n -lt 1 ] && n=1; [ $n -gt 4 ] && n=4; echo $n)}"

cuda_test_files() {  # every test file with a cuda mark, CUDA_FIRST first
  local f all
  all="$(grep -rl -E 'mark\.cuda' --include='test_*.py' tests 2>/dev/null | sed 's|^tests/||' | sort)"
  for f in $CUDA_FIRST; do case " $(echo $all) " in *" $f "*) echo "$f" ;; esac; done
  for f in $all; do case " $CUDA_FIRST " in *" $f "*) ;; *) echo "$f" ;; esac; done
}

# -- is there a GPU, and can torch use it? -----------------------------------------
if [ $plan -eq 0 ]; then
  gpu_seen=0
  if command -v nvidia-smi > /dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then gpu_seen=1; fi
  probe="$(timeout 120 "$py" -c 'import torch
torch.cuda.init()
M, m = torch.cuda.get_device_capability(0)
print("MLA_PROBE", f"{M}.{m}" + ("a" if M >= 9 else ""), torch.cuda.get_device_name(0))' 2>&1)"
  probe_rc=$?
  found="$(echo "$probe" | grep '^MLA_PROBE ' | tail -n 1)"
  if [ $probe_rc -eq 0 ] && [ -n "$found" ]; then
    found="${found#MLA_PROBE }"
    mode=gpu; arch="${found%% *}"
    echo "GPU: ${found#* } (arch $arch)"
  elif [ $gpu_seen -eq 1 ]; then
    echo "nvidia-smi lists a GPU but torch cannot initialise CUDA; stopping (no CPU dry run on a GPU machine):"
    echo "$probe" | tail -n 20
    nvidia-smi -L 2>&1 | head -n 4
    echo "$probe" | tail -n 40 > "$work/logs/cuda_init.log"
    record cuda_init "FAIL" "$(elapsed)" 120 "torch cannot initialise CUDA: $(echo "$probe" | tail -n 1 | cut -c1-160)"
    mode=gpu; publish cuda_init; cat "$work/summary.md"
    exit 2
  else
    mode=cpu; arch="${TORCH_CUDA_ARCH_LIST:-8.6;9.0a}"
    echo "no GPU visible: CPU-side dry run (build for $arch, info, demo, benchmarks at CPU sizes)"
  fi
  export TORCH_CUDA_ARCH_LIST="$arch"
  export MLA_EXT_CUDA_PTX="${MLA_EXT_CUDA_PTX-}"  # its own arch only: no PTX to JIT elsewhere, a shorter build
  if [ $mode = gpu ]; then export MLA_EXT_CUDA=1; else export MLA_EXT_CUDA="${MLA_EXT_CUDA:-auto}"; fi
fi

# -- the run ---------------------------------------------------------------------------
step facts facts $CAP_FACTS 10 bash -c facts
step build build $CAP_BUILD 30 bash -c build
built=$?
step info info $CAP_INFO 10 "$py" -m mla_ext info

if [ "$mode" = gpu ]; then
  pool cuda $CAP_CUDA $CAP_CUDA_FILE 15 cuda_file $(cuda_test_files)
  san="$(command -v compute-sanitizer || true)"
  for d in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /x/y)")")")" /usr/local/cuda; do
    [ -z "$san" ] && [ -n "$d" ] && [ -x "$d/bin/compute-sanitizer" ] && san="$d/bin/compute-sanitizer"
  done
  export san
  if [ $plan -eq 0 ] && [ -z "$san" ]; then
    record memcheck "SKIPPED" 0 0 "no compute-sanitizer on PATH, in \$CUDA_HOME/bin or /usr/local/cuda/bin"
  elif [ $plan -eq 0 ] && [ $built -ne 0 ]; then
    record memcheck "SKIPPED" 0 0 "the build failed or did not run"
  else
    pool memcheck $CAP_MEMCHECK $CAP_MEMCHECK_FILE 20 memcheck_file $MEMCHECK_FILES
  fi
  if [ $plan -eq 0 ] && { [ -z "$san" ] || [ $built -ne 0 ]; }; then
    record racecheck "SKIPPED" 0 0 "no compute-sanitizer, or the build failed"
  else
    step racecheck racecheck $CAP_RACECHECK 12 bash -c racecheck_calls
  fi
  step demo demo $CAP_DEMO 20 "$py" -m mla_ext demo --full --progress off
  step bench_kv_b_proj bench_kv_b_proj $CAP_KVB 20 "$py" benchmarks/bench_kv_b_proj.py --sweep --out "${work:-W}/bench"
  step bench_prefill bench_prefill $CAP_PREFILL 20 "$py" benchmarks/bench_prefill.py --quick --out "${work:-W}/bench"
  step bench_absorbed bench_absorbed $CAP_ABSORBED 15 "$py" benchmarks/bench_absorbed.py --quick --out "${work:-W}/bench"
  step bench_cache bench_cache $CAP_GATHER 12 "$py" benchmarks/bench_cache.py --reps 10 --out "${work:-W}/bench"
  step bench_attention bench_attention $CAP_ATTENTION 12 "$py" benchmarks/bench_attention.py --out "${work:-W}/bench"
  step bench_sparse bench_sparse $CAP_SPARSE 10 "$py" benchmarks/bench_sparse.py --quick --out "${work:-W}/bench"
  step bench_vllm_sparse bench_vllm_sparse $CAP_VLLM_SPARSE 8 "$py" benchmarks/bench_vllm_sparse.py --quick --out "${work:-W}/bench"
else
  record cuda "SKIPPED" 0 0 "no GPU"
  record memcheck "SKIPPED" 0 0 "no GPU"
  record racecheck "SKIPPED" 0 0 "no GPU"
  step demo demo $CAP_DEMO 20 "$py" -m mla_ext demo --progress off
  step bench_kv_b_proj bench_kv_b_proj $CAP_KVB 20 "$py" benchmarks/bench_kv_b_proj.py --sweep --out "${work:-W}/bench"
  step bench_prefill bench_prefill $CAP_PREFILL 20 "$py" benchmarks/bench_prefill.py --quick --out "${work:-W}/bench"
  step bench_absorbed bench_absorbed $CAP_ABSORBED 15 "$py" benchmarks/bench_absorbed.py --quick --out "${work:-W}/bench"
  step bench_cache bench_cache $CAP_GATHER 12 "$py" benchmarks/bench_cache.py --quick --out "${work:-W}/bench"
  step bench_attention bench_attention $CAP_ATTENTION 12 "$py" benchmarks/bench_attention.py --quick --out "${work:-W}/bench"
  step bench_sparse bench_sparse $CAP_SPARSE 10 "$py" benchmarks/bench_sparse.py --quick --out "${work:-W}/bench"
  step bench_vllm_sparse bench_vllm_sparse $CAP_VLLM_SPARSE 8 "$py" benchmarks/bench_vllm_sparse.py --quick --out "${work:-W}/bench"
fi

if [ $plan -eq 1 ]; then
  echo "PLAN end=$(elapsed) sum_of_caps=$((CAP_FACTS + CAP_BUILD + CAP_INFO + CAP_CUDA + CAP_MEMCHECK + CAP_RACECHECK + CAP_DEMO + CAP_KVB + CAP_PREFILL + CAP_ABSORBED + CAP_GATHER + CAP_ATTENTION + CAP_SPARSE + CAP_VLLM_SPARSE))"
  exit 0
fi
record total "" "$(elapsed)" "$DEADLINE" "$failures step(s) failed"
publish total
echo
cat "$work/summary.md"
echo
echo "OUTDIR $out ($(find "$out" -type f | wc -l) files): $(cd "$out" && ls | tr '\n' ' ')"
[ $failures -eq 0 ]
