#!/usr/bin/env bash
# bench:train's CPU rows run end to end as `coloctl train` runs a job: an
# embedded cluster of worker daemons per row (tiny GPT-2 at tp=1, tp=2, dp=2;
# an 8-layer one in two pipeline stages, 1F1B and interleaved), the job over gRPC, the steps from rank 0's
# progress events. What the rows compute is tested by the trainer's own tests;
# this holds the benchmark's wiring (the daemons found beside it, the job
# spec, the step times and pipeline waits read back), and that the table is
# printed once (a daemon forked from the benchmark must not flush its
# buffered output a second time).
set -euo pipefail
train=$1
fail() { printf 'FAIL: %s\n' "$1"; printf '%s\n' "$2"; exit 1; }

work=${TEST_TMPDIR:-$(mktemp -d)}
out=$("$train" --rows cpu --model gpt2-tiny --steps 1 --warmup 1 --work_dir "$work" 2>&1) || fail "bench:train exited $?" "$out"
[[ $(grep -c '^model ' <<<"$out") == 1 ]] || fail "the table's header is not printed exactly once" "$out"
[[ $(grep -c '^OpenBLAS sgemm 1024^3, [0-9]* threads (every core): [0-9.]* GFLOP/s' <<<"$out") == 1 ]] ||
  fail "no single peak line" "$out"
for layout in "tp=1 dp=1" "tp=2 dp=1" "tp=1 dp=2"; do
  grep -qE "^gpt2-tiny +cpu +$layout +fp32 +3\.2M +1024 +[0-9.]+ +[1-9][0-9]* +[0-9.e+]+ +[0-9.e+]+ +[0-9.]+% +[0-9.]+x +-$" \
    <<<"$out" || fail "no timed gpt2-tiny $layout row" "$out"
done
# The pipeline rows (a model of 8 layers, 8 sequences here to keep it short):
# the stages' measured idle time over the span beside the schedule's closed
# form (1F1B's 1/5 and 1/9, interleaved's 1/9 and 1/17), and over the busy
# time beside (p - 1) / (V m) (1/4, 1/8, 1/8, 1/16).
pipe=$("$train" --rows cpu --model gpt2-pipe --steps 1 --warmup 1 --batch 8 --work_dir "$work" 2>&1) ||
  fail "bench:train's pipeline rows exited $?" "$pipe"
bubble='[0-9]+\.[0-9]%'
for want in "m=4 +fp32 .* $bubble \(20\.0%\); $bubble \(25\.0%\)" "m=8 +fp32 .* $bubble \(11\.1%\); $bubble \(12\.5%\)" \
  "m=4 v=2 +fp32 .* $bubble \(11\.1%\); $bubble \(12\.5%\)" "m=8 v=2 +fp32 .* $bubble \(5\.9%\); $bubble \(6\.2%\)"; do
  grep -qE "^gpt2-pipe +cpu +tp=1 pp=2 dp=1 $want$" <<<"$pipe" || fail "no gpt2-pipe pp=2 row $want with its bubble" "$pipe"
done
echo "PASS: bench:train's CPU rows on an embedded cluster"
