#!/usr/bin/env bash
# coloctl installed alone, as on an orchestration host (README "Which binary
# goes where"): it links no trainer, kernel or communication library, its
# gRPC and spec commands run, and a command that computes in-process says
# that coloctl-run is missing (FAILED_PRECONDITION, exit 1) instead of
# failing some other way.
set -euo pipefail
coloctl=$1
fail() { printf 'FAIL: %s\n' "$1"; printf '%s\n' "${2:-}"; exit 1; }
tmp=${TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$tmp/bin" "$tmp/model"
cp "$coloctl" "$tmp/bin/coloctl"  # a copy: nothing of the build tree beside it
export PATH=/usr/bin:/bin         # and no coloctl-run on $PATH

libs=$(ldd "$tmp/bin/coloctl")
for lib in libopenblas libgloo libcudart libcublas libnccl libcudnn; do
  if grep -q "$lib" <<<"$libs"; then fail "coloctl links $lib" "$libs"; fi
done

# A spec command: coloctl plan reads config.json alone.
cat > "$tmp/model/config.json" <<'JSON'
{"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}
JSON
out=$("$tmp/bin/coloctl" plan --model "$tmp/model" --tp 2 --batch-size 4 --seq-len 32 2>&1) ||
  fail "coloctl plan exited $?" "$out"
grep -q "parameters" <<<"$out" || fail "coloctl plan printed no plan" "$out"

# The in-process commands: each names what is missing.
for cmd in "init-model --out $tmp/new" "tokenize" "consolidate --checkpoint $tmp/ck --out $tmp/c" \
  "train --device cuda --model $tmp/model --data /dev/null" "forward --device cuda --model $tmp/model"; do
  set +e
  # shellcheck disable=SC2086
  out=$("$tmp/bin/coloctl" $cmd 2>&1)
  code=$?
  set -e
  [[ $code == 1 ]] || fail "coloctl $cmd exited $code, not 1" "$out"
  grep -q "FAILED_PRECONDITION" <<<"$out" || fail "coloctl $cmd: no FAILED_PRECONDITION" "$out"
  grep -q "coloctl-run is not installed beside coloctl or on \$PATH" <<<"$out" ||
    fail "coloctl $cmd does not say coloctl-run is missing" "$out"
done
[[ ! -e $tmp/new ]] || fail "init-model wrote something without coloctl-run"
echo "PASS: coloctl alone"
