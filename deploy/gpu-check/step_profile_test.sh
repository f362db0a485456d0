#!/bin/bash
# step_profile_test.py (gpu-check's step timeline from an Nsight Systems
# trace) with Debian's python3.
set -euo pipefail
here=${RUNFILES_DIR:-${TEST_SRCDIR:-$0.runfiles}}/colod/deploy/gpu-check
export PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3 "$here/step_profile_test.py"
