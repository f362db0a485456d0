#!/bin/bash
# Runs a fuzz target as a test: fuzz_test.sh BINARY SECONDS CORPUS_FILE...
# Under --config=fuzz the binary is libFuzzer: it fuzzes for SECONDS (or
# $COLOD_FUZZ_SECONDS) from a writable copy of the seed corpus, under
# ASan + UBSan, and any crash, leak, sanitizer report or input slower than
# 10 s fails the test (the input is kept in the test's outputs). The
# mutations follow $COLOD_FUZZ_SEED (1), so a run is repeatable and CI
# explores the same inputs each time; set another seed (or 0: from the
# clock) to explore new ones. Elsewhere the binary replays the seed corpus.
set -euo pipefail
bin=$1 seconds=$2
shift 2
seconds=${COLOD_FUZZ_SECONDS:-$seconds}
corpus="${TEST_TMPDIR:-/tmp}/corpus"
rm -rf "$corpus"
mkdir -p "$corpus"
for f in "$@"; do cp "$f" "$corpus/"; done
artifacts="${TEST_UNDECLARED_OUTPUTS_DIR:-${TEST_TMPDIR:-/tmp}}/"
exec "$bin" -seed="${COLOD_FUZZ_SEED:-1}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$artifacts" "$corpus"
