#!/bin/bash
# gpu-check.sh's selection of tests and bench:train rows, and its verdict,
# on a bundle this test writes: three test "binaries" (scripts that write
# gtest's XML; one fails on request), a bench:train that records its
# arguments, and an nvidia-smi that lists one GPU. What the real binaries
# do on a GPU is gpu-check's to run; this holds what the script runs, what
# its report says it left out, and its exit status.
set -euo pipefail
here=${RUNFILES_DIR:-${TEST_SRCDIR:-$0.runfiles}}/colod/deploy/gpu-check
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/gpu-check-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { printf 'FAIL: %s\n' "$1"; [[ -f ${2:-/nonexistent} ]] && cat "$2"; exit 1; }

bundle=$work/bundle
mkdir -p "$bundle/colod/worker/nn" "$bundle/colod/kernels" "$bundle/colod/client" "$bundle/colod/worker/daemon" \
  "$bundle/opt/colod/bench" "$bundle/lib" "$work/cuda/lib64" "$work/bin"
cp "$here/gpu-check.sh" "$bundle/"
echo 0123abc >"$bundle/COMMIT"
echo 13.0 >"$bundle/CUDA_VERSION"
printf '%s\n' worker/nn/cuda_attention_test kernels/cuda_warp_test worker/nn/cuda_mlp_test >"$bundle/tests.txt"
for t in worker/nn/cuda_attention_test kernels/cuda_warp_test worker/nn/cuda_mlp_test; do
  # A test: records that it ran, writes two cases (one skipped) to the XML
  # gpu-check names, and fails where FAIL_TEST names it.
  cat >"$bundle/colod/$t" <<EOF
#!/bin/bash
echo "$t" >>"$work/ran"
xml=\${1#--gtest_output=xml:}
printf '<testsuites>\n<testcase name="A" classname="S"/>\n<testcase name="B" result="skipped" classname="S"/>\n' >"\$xml"
if [[ \${FAIL_TEST:-} == "$t" ]]; then
  printf '<testcase name="C" classname="S"><failure message="x"/></testcase>\n</testsuites>\n' >>"\$xml"
  echo "[  FAILED  ] S.C"
  exit 1
fi
echo '</testsuites>' >>"\$xml"
EOF
  chmod +x "$bundle/colod/$t"
  : >"$bundle/colod/$t.env"
done
for f in client/coloctl client/coloctl-run worker/daemon/colod-worker; do
  printf '#!/bin/bash\n' >"$bundle/colod/$f"
  chmod +x "$bundle/colod/$f"
done
cat >"$bundle/opt/colod/bench/train" <<EOF
#!/bin/bash
printf '<%s>' "\$@" >"$work/train-args"
printf '[%s]' "\${COLOD_ATTENTION:-}" >>"$work/train-attention"
echo "gpt2-124m  cuda  tp=1 dp=1  bf16  row"
EOF
chmod +x "$bundle/opt/colod/bench/train"
for l in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do : >"$work/cuda/lib64/$l"; done
cat >"$work/bin/nvidia-smi" <<'EOF'
#!/bin/bash
[[ ${1:-} == -L ]] && { echo "GPU 0: NVIDIA H200 (UUID: GPU-test)"; exit 0; }
echo "index, name, memory.total [MiB], driver_version, compute_cap"
echo "0, NVIDIA H200, 143771 MiB, 580.0, 9.0"
EOF
chmod +x "$work/bin/nvidia-smi"

# Runs gpu-check.sh with the fake GPU and CUDA libraries (none searched for
# elsewhere: what this machine has is not the test's), no PyTorch and no
# profiler; $1 is the output directory, the rest are VAR=value settings.
# Sets rc.
check() {
  local out=$1
  shift
  rm -f "$work/ran" "$work/train-args" "$work/train-attention"
  set +e
  env PATH="$work/bin:$PATH" COLOD_CUDA_HOME="$work/cuda" COLOD_GPU_CHECK_LIB_SEARCH="$work/cuda" \
    COLOD_GPU_CHECK_PYTORCH=none COLOD_GPU_CHECK_PROFILE=none \
    "$@" "$bundle/gpu-check.sh" "$out" >"$work/stdout" 2>"$work/stderr"
  rc=$?
  set -e
}

# Every test, and no bench: the three ran, six cases of which three skipped.
check "$work/all" COLOD_GPU_CHECK_BENCH=
((rc == 0)) || fail "every test passing: exit $rc" "$work/stderr"
[[ $(sort "$work/ran" | tr '\n' ' ') == "kernels/cuda_warp_test worker/nn/cuda_attention_test worker/nn/cuda_mlp_test " ]] ||
  fail "not every test ran" "$work/ran"
grep -q '^## Tests (6 cases, 3 skipped; 0 of 3 binaries failed)$' "$work/all/report.md" ||
  fail "the report does not count the tests" "$work/all/report.md"
if grep -q 'left out\|COLOD_GPU_CHECK_TESTS' "$work/all/report.md"; then
  fail "a run of every test reports some left out" "$work/all/report.md"
fi

# A failing test fails the check, and its line reaches the report.
check "$work/failing" COLOD_GPU_CHECK_BENCH= FAIL_TEST=kernels/cuda_warp_test
((rc == 1)) || fail "a failing test: exit $rc, not 1" "$work/stderr"
grep -q '^//kernels:cuda_warp_test FAILED in [0-9]* s (3 cases, 1 skipped, 1 failed)$' "$work/failing/report.md" ||
  fail "the report has no FAILED line for the failing test" "$work/failing/report.md"
grep -q '^\[  FAILED  \] S.C$' "$work/failing/report.md" || fail "the failure's own line is not in the report" \
  "$work/failing/report.md"

# A selection: only the attention test runs; the others are named as left
# out, and a failing test left out does not fail the check.
check "$work/some" COLOD_GPU_CHECK_BENCH= COLOD_GPU_CHECK_TESTS='attention' FAIL_TEST=kernels/cuda_warp_test
((rc == 0)) || fail "a selection without the failing test: exit $rc" "$work/stderr"
[[ $(cat "$work/ran") == worker/nn/cuda_attention_test ]] || fail "the selection ran other tests" "$work/ran"
grep -q "^Tests selected by COLOD_GPU_CHECK_TESTS='attention': 1 of 3\.$" "$work/some/report.md" ||
  fail "the report does not say what was selected" "$work/some/report.md"
for t in //kernels:cuda_warp_test //worker/nn:cuda_mlp_test; do
  grep -qF "$t (left out by COLOD_GPU_CHECK_TESTS)" "$work/some/report.md" ||
    fail "the report does not name $t as left out" "$work/some/report.md"
done
grep -q '^## Tests (2 cases, 1 skipped; 0 of 1 binaries failed)$' "$work/some/report.md" ||
  fail "the report counts tests that did not run" "$work/some/report.md"

# "none": no test runs, every one is named; bench:train runs the rows asked
# for, the layout's space kept inside one argument.
check "$work/none" COLOD_GPU_CHECK_BENCH=train COLOD_GPU_CHECK_TESTS=none COLOD_GPU_CHECK_TRAIN_MODEL=gpt2-124m \
  COLOD_GPU_CHECK_TRAIN_LAYOUT='tp=1 dp=1'
((rc == 0)) || fail "no tests: exit $rc" "$work/stderr"
[[ ! -e $work/ran ]] || fail "COLOD_GPU_CHECK_TESTS=none ran tests" "$work/ran"
[[ $(grep -c '(left out by COLOD_GPU_CHECK_TESTS)$' "$work/none/report.md") == 3 ]] ||
  fail "the report does not name all three tests as left out" "$work/none/report.md"
[[ $(cat "$work/train-args") == '<--rows><gpu><--model><gpt2-124m><--layout><tp=1 dp=1>' ]] ||
  fail "bench:train got other arguments: $(cat "$work/train-args")"
grep -q "^bench: bench:train's rows other than --model gpt2-124m --layout tp=1 dp=1" "$work/none/report.md" ||
  fail "the report does not say bench:train ran some rows only" "$work/none/report.md"
grep -q '^gpt2-124m  cuda  tp=1 dp=1  bf16  row$' "$work/none/report.md" ||
  fail "bench:train's output is not in the report" "$work/none/report.md"

# Without the settings bench:train gets its default rows.
check "$work/train" COLOD_GPU_CHECK_BENCH=train COLOD_GPU_CHECK_TESTS=none
[[ $(cat "$work/train-args") == '<--rows><gpu>' ]] || fail "bench:train's default arguments: $(cat "$work/train-args")"

# train-cudnn: bench:train's rows again, with cuDNN's attention asked for.
check "$work/cudnn" COLOD_GPU_CHECK_BENCH='train train-cudnn' COLOD_GPU_CHECK_TESTS=none
((rc == 0)) || fail "train-cudnn: exit $rc" "$work/stderr"
[[ $(cat "$work/train-attention") == '[][cudnn]' ]] ||
  fail "bench:train ran with COLOD_ATTENTION $(cat "$work/train-attention"), not unset then cudnn"
grep -q '^## bench:train-cudnn$' "$work/cudnn/report.md" || fail "the report has no train-cudnn table" "$work/cudnn/report.md"

# A regex grep cannot read is refused before anything runs.
check "$work/bad" COLOD_GPU_CHECK_TESTS='(' COLOD_GPU_CHECK_BENCH=
((rc == 1)) || fail "a bad regex: exit $rc, not 1" "$work/stderr"
grep -q "COLOD_GPU_CHECK_TESTS: '(' is not an extended regex" "$work/stderr" ||
  fail "a bad regex is not named" "$work/stderr"
[[ ! -e $work/ran ]] || fail "a bad regex ran tests" "$work/ran"
echo PASS
