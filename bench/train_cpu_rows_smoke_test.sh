#!/usr/bin/env bash
# bench:train's CPU rows run end to end as `coloctl train` runs a job: an
# embedded cluster of worker daemons per row (tiny GPT-2 at tp=1, tp=2, dp=2
# and two pipeline stages), the job over gRPC, the steps from rank 0's
# progress events. What the rows compute is tested by the trainer's own tests;
# this holds the benchmark's wiring (the daemons found beside it, the job
# spec, the step times and pipeline waits read back), and that the table is
# printed once (a daemon forked from the benchmark must not flush its
# buffered output a second time).
set -euo pipefail
train=$1
fail() { printf 'FAIL: %s\n' "$1"; printf '%s\n' "$2"; exit 1; }

out=$("$train" --rows cpu --model gpt2-tiny --steps 1 --warmup 1 --work_dir "${TEST_TMPDIR:-$(mktemp -d)}" 2>&1) || fail "bench:train exited $?" "$out"
[[ $(grep -c '^model ' <<<"$out") == 1 ]] || fail "the table's header is not printed exactly once" "$out"
[[ $(grep -c '^OpenBLAS sgemm 1024^3, [0-9]* threads (every core): [0-9.]* GFLOP/s' <<<"$out") == 1 ]] ||
  fail "no single peak line" "$out"
for layout in "tp=1 dp=1" "tp=2 dp=1" "tp=1 dp=2"; do
  grep -qE "^gpt2-tiny +cpu +$layout +fp32 +3\.2M +1024 +[0-9.]+ +[1-9][0-9]* +[0-9.e+]+ +[0-9.e+]+ +[0-9.]+% +[0-9.]+x +-$" \
    <<<"$out" || fail "no timed gpt2-tiny $layout row" "$out"
done
for m in 4 8; do  # the pipeline rows: rank 0's measured wait beside 1F1B's closed form
  grep -qE "^gpt2-tiny +cpu +tp=1 pp=2 dp=1 m=$m +fp32 .* [0-9.]+x +[0-9]+% \([0-9]+%\)$" <<<"$out" ||
    fail "no gpt2-tiny pp=2 m=$m row with its bubble" "$out"
done
echo "PASS: bench:train's CPU rows on an embedded cluster"
