#!/bin/bash
# The Python client against live daemons (bazel test //examples/python:example_test):
#  1. the stubs generated into $TEST_TMPDIR (gen_stubs.sh);
#  2. an embedded cluster (coloctl local --workers 4) and a tiny GPT-2
#     (coloctl init-model), and example.py run against it: a tp=2 dp=2 TRAIN
#     job to SUCCEEDED with its watch dropped and resumed (and, with short
#     WatchJob deadlines, resumed again on its own), the duplicate request_id,
#     the mesh's groups, an uploaded job cancelled;
#  3. a lone coordinator with mutual TLS and a bearer token, which
#     colod_client.py reaches with the CA, its certificate and the token, and
#     which refuses it without the token or without TLS.
# Everything started here is stopped on exit, whatever happens.
set -euo pipefail

# Debian's python3 with python3-grpcio and python3-protobuf, whatever $PATH says.
PYTHON=/usr/bin/python3
export PYTHONDONTWRITEBYTECODE=1

runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-$0.runfiles}}/colod
here=$runfiles/examples/python
tmp=${TEST_TMPDIR:-$(mktemp -d /tmp/colod-python-example.XXXXXX)}
coloctl=$runfiles/client/coloctl
coordinator_bin=$runfiles/server/colod-coordinator

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    # coloctl local stops its daemons within ~10 s of SIGTERM; then SIGKILL.
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT

# Prints the value of the first line of FILE that matches the sed expression
# EXPR, waiting up to SECONDS while process PID lives.
wait_for_line() {
  local file=$1 expr=$2 seconds=$3 pid=$4 value=""
  for _ in $(seq 1 $((seconds * 10))); do
    value=$(sed -n "$expr" "$file" 2>/dev/null | head -1)
    [[ -n $value ]] && { echo "$value"; return 0; }
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

"$PYTHON" -c 'import grpc, google.protobuf' 2>/dev/null ||
  fail "$PYTHON lacks grpc or protobuf: apt-get install python3-grpcio python3-protobuf"

echo "== stubs"
"$here/gen_stubs.sh" "$tmp/stubs"
export COLOD_PY_STUBS=$tmp/stubs

echo "== an embedded cluster: coloctl local --workers 4"
"$coloctl" local --workers 4 --listen 127.0.0.1:0 --data-dir "$tmp/cluster" >"$tmp/local.out" 2>"$tmp/local.err" &
pids+=($!)
address=$(wait_for_line "$tmp/local.out" 's/^ready: .*COLOD_COORDINATOR=\([^;]*\);.*/\1/p' 90 "${pids[-1]}") ||
  fail "the cluster did not come up: $(cat "$tmp/local.out" "$tmp/local.err")"
cat "$tmp/local.out"
"$coloctl" init-model --out "$tmp/gpt2" --vocab-size 257 --hidden-size 64 --layers 2 --heads 4 --positions 64

echo "== example.py"
# WatchJob calls of 0.3 s: the resumed watch also reconnects on its own, from
# the next sequence each time, while the job runs.
"$PYTHON" "$here/example.py" --coordinator "$address" --model "$tmp/gpt2" \
  --tp 2 --dp 2 --steps 20 --call-timeout 0.3 --watch-timeout 120 | tee "$tmp/example.out" ||
  fail "example.py failed (the cluster's logs are in $tmp/cluster)"
grep -q '^== all checks passed' "$tmp/example.out" || fail "example.py did not finish"

echo "== mutual TLS and a bearer token: a lone coordinator"
openssl() { /usr/bin/openssl "$@" 2>>"$tmp/openssl.log" >/dev/null || fail "openssl $1: $(cat "$tmp/openssl.log")"; }
(
  cd "$tmp"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.pem \
    -days 1 -subj /CN=colod-example-ca
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout node.key -out node.csr \
    -subj /CN=localhost
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' >node.ext
  openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out node.pem -days 1 -extfile node.ext
)
echo "s3cret-$RANDOM$RANDOM" >"$tmp/token"
echo "wrong" >"$tmp/wrong-token"
"$coordinator_bin" --data-dir "$tmp/secure" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --ready-file "$tmp/secure.ready" --auth-token-file "$tmp/token" \
  --tls-cert "$tmp/node.pem" --tls-key "$tmp/node.key" --tls-ca "$tmp/ca.pem" 2>"$tmp/secure.log" &
pids+=($!)
secure=$(wait_for_line "$tmp/secure.ready" 's/^grpc=//p' 30 "${pids[-1]}") ||
  fail "the TLS coordinator did not come up: $(cat "$tmp/secure.log")"
tls=(--tls-ca "$tmp/ca.pem" --tls-cert "$tmp/node.pem" --tls-key "$tmp/node.key")
client() { "$PYTHON" "$here/colod_client.py" --coordinator "$secure" --timeout 5 --max-attempts 1 "$@"; }

out=$(client "${tls[@]}" health) || fail "health over mutual TLS: $out"
[[ $out == SERVING ]] || fail "health over mutual TLS: '$out', expected SERVING"
echo "health without a token, over mutual TLS: $out"
client "${tls[@]}" --token-file "$tmp/token" jobs >/dev/null || fail "ListJobs with the token over mutual TLS failed"
echo "ListJobs with the token over mutual TLS: ok"
expect_refused() {  # CODE DESCRIPTION ARGS...
  local code=$1 what=$2 err
  shift 2
  if err=$(client "$@" jobs 2>&1); then fail "$what: the call went through"; fi
  [[ $err == *"$code"* ]] || fail "$what: '$err', expected $code"
  echo "$what: $code"
}
expect_refused UNAUTHENTICATED "no token" "${tls[@]}"
expect_refused UNAUTHENTICATED "a wrong token" "${tls[@]}" --token-file "$tmp/wrong-token"
expect_refused UNAVAILABLE "plaintext to the TLS port" --token-file "$tmp/token"
expect_refused UNAVAILABLE "TLS without a client certificate" --tls-ca "$tmp/ca.pem" --token-file "$tmp/token"

echo "PASS"
