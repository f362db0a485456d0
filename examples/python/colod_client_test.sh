#!/bin/bash
# colod_client_test.py (no daemons: a scripted coordinator in the test) with
# Debian's python3 and stubs generated into $TEST_TMPDIR.
set -euo pipefail
runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-$0.runfiles}}/colod
here=$runfiles/examples/python
tmp=${TEST_TMPDIR:-$(mktemp -d /tmp/colod-python-test.XXXXXX)}
/usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null || {
  echo "FAIL: /usr/bin/python3 lacks grpc or protobuf: apt-get install python3-grpcio python3-protobuf" >&2
  exit 1
}
"$here/gen_stubs.sh" "$tmp/stubs"
export COLOD_PY_STUBS=$tmp/stubs PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3 "$here/colod_client_test.py"
