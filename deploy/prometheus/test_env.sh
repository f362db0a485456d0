#!/bin/bash
# Sourced by the shell tests of deploy/prometheus and deploy/grafana:
#   source test_env.sh DIR
# defines fail(), enters DIR (the test's package, in its runfiles under
# Bazel), sets $tmp (TEST_TMPDIR, or a fresh directory when run by hand) and
# $promtool (Debian's prometheus package), failing with what to install.

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

if [[ -n "${TEST_SRCDIR:-}" ]]; then
  cd "${TEST_SRCDIR}/${TEST_WORKSPACE}/$1"
fi
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
promtool="$(command -v promtool || true)"
[[ -n "$promtool" ]] ||
  fail "promtool is not on PATH ($PATH): install Debian's prometheus package (apt-get install prometheus)"
