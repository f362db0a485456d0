#!/usr/bin/env bash
# colod gpu-check from a bundle (`./dev gpu-bundle`, docs/GPU.md): the GPU
# tests and the benchmarks of the default build (nvcc, cuBLAS, NCCL) on this
# machine's NVIDIA GPUs, and one report. It needs neither Bazel nor Debian's
# packages: the bundle carries the binaries and the Debian libraries they link,
# and takes glibc, the driver, cuBLAS and NCCL from this machine.
#
#   ./gpu-check.sh [OUT_DIR]      (default: ./out; the report is OUT_DIR/report.md)
#
# Environment: COLOD_CUDA_HOME (where cuBLAS, NCCL, cuDNN and NVRTC are looked
# for first; default /usr/local/cuda), COLOD_GPU_CHECK_LIB_SEARCH (the
# directories searched for them after that and the system's library
# directories; default "/usr /opt"), COLOD_GPU_CHECK_TEST_TIMEOUT (seconds per test
# binary, default 600), COLOD_GPU_CHECK_BENCH (benchmarks to run, default
# "layers collectives train train-cudnn", the last bench:train's rows with
# COLOD_ATTENTION=cudnn; empty for none), COLOD_GPU_CHECK_BENCH_TIMEOUT
# (seconds per benchmark, default 1200), COLOD_GPU_CHECK_PYTORCH (the python3
# that runs bench/pytorch_gpt2.py's GPU rows beside bench:train's, default
# python3 where it imports torch with CUDA; "none" skips them; rows from
# COLOD_GPU_CHECK_PYTORCH_ROWS, default sdpa,tuned,compile), COLOD_GPU_CHECK_PROFILE (the nsys that
# traces a GPT-2 124M step for step_profile.py's timeline, default nsys on PATH or under
# COLOD_CUDA_HOME or /opt/nvidia; "none" skips it), COLOD_GPU_CHECK_SANITIZER (memcheck,
# racecheck, synccheck or initcheck: each test under compute-sanitizer with
# that tool, its findings failing the test; CUDA API errors are not reported,
# since NCCL probes kernels this device has no image of), COLOD_GPU_CHECK_TESTS (an
# extended regex: only the tests whose path, worker/nn/cuda_attention_test say,
# matches it run; "none" runs none; the report names those left out),
# COLOD_GPU_CHECK_TRAIN_MODEL and COLOD_GPU_CHECK_TRAIN_LAYOUT (bench:train's
# --model and --layout: only those rows, "gpt2-124m" and "tp=1 dp=1" say).
set -uo pipefail
root=$(cd "$(dirname "$0")" && pwd)
out=$(mkdir -p "${1:-$root/out}" && cd "${1:-$root/out}" && pwd)
die() { printf 'gpu-check: %s\n' "$*" >&2; exit 1; }
log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

[[ -f $root/tests.txt && -d $root/colod ]] || die "run the copy of gpu-check.sh inside a bundle (./dev gpu-bundle makes one)"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  die "no NVIDIA GPU is visible (nvidia-smi -L lists none)"
fi

# cuBLAS and NCCL are hundreds of MB, so the bundle leaves them to the machine:
# the CUDA toolkit's lib64, else wherever under /usr or /opt they are (a
# Python wheel's copy, say).
cuda=${COLOD_CUDA_HOME:-/usr/local/cuda}
find_lib() {
  local d
  for d in "$cuda/lib64" "$cuda/lib" /usr/lib/x86_64-linux-gnu /usr/lib64; do
    [[ -e $d/$1 ]] && { echo "$d"; return; }
  done
  # shellcheck disable=SC2086 # a list of directories
  d=$(find ${COLOD_GPU_CHECK_LIB_SEARCH:-/usr /opt} -name "$1" -print 2>/dev/null | head -1)
  [[ -n $d ]] && dirname "$d"
}
libpath=$root/lib
for l in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  d=$(find_lib "$l") || true
  [[ -n $d ]] || die "$l is not on this machine (set COLOD_CUDA_HOME to the CUDA toolkit)"
  [[ :$libpath: == *":$d:"* ]] || libpath=$libpath:$d
done
# cuDNN (COLOD_ATTENTION=cudnn: its fused attention, loaded at run time) and
# NVRTC, which compiles its attention kernels, where the machine has them (a
# PyTorch wheel's copies will do). Without them the cuDNN tests fail saying
# so and the cuDNN rows run colod's kernels.
cudnn_dirs=""
for l in libcudnn.so.9 libnvrtc.so.13; do
  d=$(find_lib "$l") || true
  [[ -n $d ]] || continue
  cudnn_dirs="$cudnn_dirs $d/$l"
  [[ :$libpath: == *":$d:"* ]] || libpath=$libpath:$d
done
export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
missing=$(for f in $(cat "$root/tests.txt") client/coloctl client/coloctl-run worker/daemon/colod-worker; do ldd "$root/colod/$f"; done | grep 'not found' | sort -u)
[[ -z $missing ]] || die "libraries the binaries need are missing: $missing"

report=$out/report.md
nccl_version() {  # the NCCL that is loaded, from its own ncclGetVersion
  python3 - "$1" 2>/dev/null <<'PY' || echo '?'
import ctypes, sys
v = ctypes.c_int(); ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v)); v = v.value
print(f"{v // 10000}.{v // 100 % 100}.{v % 100}")
PY
}
{
  echo "# colod gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(cat "$root/COMMIT")"
  echo
  echo "## Devices"
  echo '```'
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap --format=csv
  echo '```'
  echo "Built with CUDA $(cat "$root/CUDA_VERSION"); on this machine cuBLAS and NCCL from" \
    "$(echo "$libpath" | cut -d: -f2- | sed 's/:/, /g'), NCCL $(nccl_version libnccl.so.2);" \
    "cuDNN and NVRTC:${cudnn_dirs:- not found (the cuDNN tests fail; the cuDNN rows run colod kernels)}"
} >"$report"

sanitizer=()
if [[ -n ${COLOD_GPU_CHECK_SANITIZER:-} ]]; then
  cs=$(command -v compute-sanitizer || echo "$cuda/bin/compute-sanitizer")
  [[ -x $cs ]] || die "COLOD_GPU_CHECK_SANITIZER: no compute-sanitizer on PATH or in $cuda/bin"
  sanitizer=("$cs" --tool "$COLOD_GPU_CHECK_SANITIZER" --report-api-errors no --error-exitcode 9)
  echo "Tests under compute-sanitizer --tool $COLOD_GPU_CHECK_SANITIZER." >>"$report"
fi

# The tests COLOD_GPU_CHECK_TESTS selects (default: every one), and those it
# leaves out.
tests=() left_out=()
filter=${COLOD_GPU_CHECK_TESTS:-}
if [[ -n $filter && $filter != none ]]; then
  grep -qE -- "$filter" <<<"" 2>/dev/null; (($? == 2)) && die "COLOD_GPU_CHECK_TESTS: '$filter' is not an extended regex"
fi
for t in $(cat "$root/tests.txt"); do
  if [[ -z $filter ]] || { [[ $filter != none ]] && grep -qE -- "$filter" <<<"$t"; }; then
    tests+=("$t")
  else
    left_out+=("$t")
  fi
done
if [[ -n $filter ]]; then
  echo "Tests selected by COLOD_GPU_CHECK_TESTS='$filter': ${#tests[@]} of $((${#tests[@]} + ${#left_out[@]}))." >>"$report"
fi
train_args=()
[[ -n ${COLOD_GPU_CHECK_TRAIN_MODEL:-} ]] && train_args+=(--model "$COLOD_GPU_CHECK_TRAIN_MODEL")
[[ -n ${COLOD_GPU_CHECK_TRAIN_LAYOUT:-} ]] && train_args+=(--layout "$COLOD_GPU_CHECK_TRAIN_LAYOUT")

# The tests: each binary as Bazel would run it (in its runfiles root, with
# TEST_SRCDIR, a TEST_TMPDIR of its own and its BUILD env), its cases counted
# from gtest's XML.
cases=0 skipped=0 failed_bins=0 lines=()
for t in "${tests[@]}"; do
  name=${t//\//_}
  tmp=$(mktemp -d)
  rm -f "$out/$name.xml"  # gtest writes it at exit: a crash must not leave the last run's
  log "gpu-check: $t"
  start=$(date +%s)
  mapfile -t env <"$root/colod/$t.env"
  (cd "$root/colod" && env TEST_SRCDIR="$root" TEST_TMPDIR="$tmp" "${env[@]}" \
    timeout -k 10 "${COLOD_GPU_CHECK_TEST_TIMEOUT:-600}" \
    "${sanitizer[@]}" "$root/colod/$t" --gtest_output="xml:$out/$name.xml" >"$out/$name.log" 2>&1)
  rc=$?
  rm -rf "$tmp"
  c=0 s=0 f=0
  if [[ -f $out/$name.xml ]]; then
    c=$(grep -c '<testcase ' "$out/$name.xml") s=$(grep -c 'result="skipped"' "$out/$name.xml")
    f=$(grep -c '<failure' "$out/$name.xml")
  fi
  cases=$((cases + c)) skipped=$((skipped + s))
  status=PASSED
  ((rc == 124)) && status=TIMEOUT
  ((rc == 137)) && status="KILLED (timeout, or out of memory)"
  ((rc != 0 && rc != 124 && rc != 137)) && status=FAILED
  ((rc != 0)) && failed_bins=$((failed_bins + 1))
  lines+=("//${t%/*}:${t##*/} $status in $(($(date +%s) - start)) s ($c cases, $s skipped, $f failed)")
  printf '%s\n' "${lines[-1]}" >&2
done
{
  echo
  echo "## Tests ($cases cases, $skipped skipped; $failed_bins of ${#lines[@]} binaries failed)"
  echo '```'
  printf '%s\n' "${lines[@]}"
  for t in "${tests[@]}"; do  # the failures' own lines
    grep -h -E '^\[  FAILED  \]|Failure|error:|^========= (ERROR|RACECHECK) SUMMARY: [1-9]' "$out/${t//\//_}.log" 2>/dev/null | head -20
  done
  echo '```'
} >>"$report"

benches=${COLOD_GPU_CHECK_BENCH-layers collectives train train-cudnn}
for bench in $benches; do
  args=() binary=$bench attention=""
  # GPT-2 124M and LLaMA 1B in bf16: tp=1 and 2, and tp=2, dp=2, pp=2 a process per GPU
  [[ $bench == train ]] && args=(--rows gpu "${train_args[@]}")
  # The same rows with cuDNN's fused attention (COLOD_ATTENTION=cudnn)
  [[ $bench == train-cudnn ]] && { binary=train attention=cudnn args=(--rows gpu "${train_args[@]}"); }
  [[ $bench == layers ]] && args=(--cpu_rows=false --hidden 4096 --tokens 8192)  # the MLP block in bf16
  log "gpu-check: bench/$binary ${args[*]}${attention:+ (COLOD_ATTENTION=$attention)}"
  COLOD_ATTENTION=$attention timeout -k 10 "${COLOD_GPU_CHECK_BENCH_TIMEOUT:-1200}" "$root/opt/colod/bench/$binary" \
    "${args[@]}" >"$out/bench-$bench.txt" 2>&1 || echo "(exit $?)" >>"$out/bench-$bench.txt"
  { echo; echo "## bench:$bench"; echo '```'; tail -40 "$out/bench-$bench.txt"; echo '```'; } >>"$report"
done
# PyTorch's side of bench:train's GPT-2 124M row, on the same GPU in the same
# run: the strongest common recipe, eager and compiled (bench/pytorch_gpt2.py).
py=${COLOD_GPU_CHECK_PYTORCH:-python3}
# Only with bench:train's rows to stand beside.
if [[ " $benches " == *" train "* && $py != none ]]; then
  if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    log "gpu-check: bench/pytorch_gpt2.py --device cuda"
    timeout -k 10 "${COLOD_GPU_CHECK_BENCH_TIMEOUT:-1200}" "$py" "$root/bench/pytorch_gpt2.py" --device cuda \
      --rows "${COLOD_GPU_CHECK_PYTORCH_ROWS:-sdpa,tuned,compile}" >"$out/bench-pytorch.txt" 2>&1 ||
      echo "(exit $?)" >>"$out/bench-pytorch.txt"
    { echo; echo "## PyTorch, bench/pytorch_gpt2.py --device cuda"; echo '```'; tail -20 "$out/bench-pytorch.txt"; echo '```'; } >>"$report"
  else
    { echo; echo "## PyTorch: not run ($py has no torch with CUDA; set COLOD_GPU_CHECK_PYTORCH)"; } >>"$report"
  fi
fi

# One GPT-2 124M step's timeline (bench:train's tp=1 row in bf16, traced by
# Nsight Systems): how long the GPU was busy and idle between the step's
# reads, the longest gaps and the kernels by time (step_profile.py).
if [[ " $benches " == *" train "* && ${COLOD_GPU_CHECK_PROFILE:-} != none ]]; then
  nsys=${COLOD_GPU_CHECK_PROFILE:-$(command -v nsys || ls "$cuda"/bin/nsys /opt/nvidia/nsight-systems*/*/bin/nsys 2>/dev/null | head -1)}
  if [[ -n $nsys && -x $nsys ]]; then
    log "gpu-check: $nsys profile bench/train, GPT-2 124M at tp=1"
    rm -f "$out"/gpt2-step.nsys-rep "$out"/gpt2-step*_cuda_gpu_trace*.csv
    { timeout -k 10 "${COLOD_GPU_CHECK_BENCH_TIMEOUT:-1200}" "$nsys" profile -t cuda -s none --cpuctxsw none \
        --force-overwrite true -o "$out/gpt2-step" "$root/opt/colod/bench/train" --rows gpu --model gpt2-124m \
        --layout "tp=1 dp=1" --steps 3 --warmup 1 &&
      "$nsys" stats --report cuda_gpu_trace --format csv --force-export true --output "$out/gpt2-step" \
        "$out/gpt2-step.nsys-rep"; } >"$out/profile.log" 2>&1 || echo "(exit $?)" >>"$out/profile.log"
    trace=$(ls "$out"/gpt2-step*_cuda_gpu_trace*.csv 2>/dev/null | head -1)
    {
      echo
      echo "## One GPT-2 124M step under Nsight Systems (bench:train, tp=1, bf16)"
      if [[ -n $trace ]]; then
        python3 "$root/step_profile.py" "$trace" 2>&1
      else
        echo '```'; tail -20 "$out/profile.log"; echo '```'
      fi
    } >>"$report"
  else
    { echo; echo "## Step timeline: not run (no nsys found; set COLOD_GPU_CHECK_PROFILE to one)"; } >>"$report"
  fi
fi

# What this machine could not run: the test cases that skipped (those that
# need more devices than nvidia-smi lists, or none) and the benchmark rows
# that said so.
{
  echo
  echo "## Not run on this machine ($(nvidia-smi -L | grep -c '^GPU ') GPU(s))"
  echo '```'
  for t in "${left_out[@]}"; do
    echo "//${t%/*}:${t##*/} (left out by COLOD_GPU_CHECK_TESTS)"
  done
  [[ " $benches " == *" train "* ]] && ((${#train_args[@]} > 0)) && echo "bench: bench:train's rows other than ${train_args[*]} (COLOD_GPU_CHECK_TRAIN_MODEL, _LAYOUT)"
  for t in "${tests[@]}"; do
    x=$out/${t//\//_}.xml
    [[ -f $x ]] || continue
    grep -o '<testcase name="[^"]*"[^>]*result="skipped"[^>]*classname="[^"]*"' "$x" |
      sed -E "s|<testcase name=\"([^\"]*)\".*classname=\"([^\"]*)\"|//${t%/*}:${t##*/} \2.\1|"
    grep -h -A1 ': Skipped$' "$out/${t//\//_}.log" 2>/dev/null | grep -v ': Skipped$\|^--$' | sort -u |
      sed 's/^/    why: /' | head -5
  done
  grep -h -E 'skipped' "$out"/bench-*.txt 2>/dev/null | sed 's/^/bench: /'
  echo '```'
} >>"$report"

cat "$report"
log "gpu-check: the report is $report (add it to docs/GPU.md)"
((failed_bins == 0))

