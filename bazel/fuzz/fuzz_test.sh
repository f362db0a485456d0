#!/bin/bash
# Runs a fuzz target as a test: fuzz_test.sh BINARY SECONDS CORPUS_FILE...
# Under --config=fuzz the binary is libFuzzer: it fuzzes for SECONDS (or
# $COLOD_FUZZ_SECONDS) from a writable copy of the seed corpus, under
# ASan + UBSan, and any crash, leak, sanitizer report or input slower than
# 10 s fails the test (the input is kept in the test's outputs, the report
# in its log). The mutations follow $COLOD_FUZZ_SEED (1), so runs explore
# much the same inputs (libFuzzer's timing-dependent choices aside); set
# another seed (or 0: from the clock) to explore new ones. Elsewhere the
# binary replays the seed corpus.
set -euo pipefail
bin=$1 seconds=$2
shift 2
seconds=${COLOD_FUZZ_SECONDS:-$seconds}
corpus="${TEST_TMPDIR:-/tmp}/corpus"
rm -rf "$corpus"
mkdir -p "$corpus"
for f in "$@"; do cp "$f" "$corpus/"; done
artifacts="${TEST_UNDECLARED_OUTPUTS_DIR:-${TEST_TMPDIR:-/tmp}}/"
# The whole log goes to the test's outputs (fuzz.log); the test log keeps
# what says why it failed: the report and the input, without the progress
# lines (thousands in a run).
log="${artifacts}fuzz.log"
rc=0
"$bin" -seed="${COLOD_FUZZ_SEED:-1}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -max_len=65536 \
  -print_final_stats=1 -print_funcs=0 -artifact_prefix="$artifacts" "$corpus" >"$log" 2>&1 || rc=$?
if ((rc != 0)); then
  echo "FAILED (exit $rc); the report (the whole log: $log):"
  grep -v -E '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse|RELOAD)|^\[libprotobuf ' "$log" | tail -n 120
  exit "$rc"
fi
tail -n 20 "$log"
