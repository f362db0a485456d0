#!/bin/bash
# Generates the Python stubs of colod's API (proto/colod/v1/*.proto) and of
# the gRPC health protocol into OUT_DIR (default: examples/python/gen, which
# git ignores), with Debian's protoc and grpc_python_plugin:
#
#   examples/python/gen_stubs.sh [OUT_DIR]
#   PYTHONPATH=OUT_DIR python3 -c 'from colod.v1 import coordinator_pb2_grpc'
#
# The stubs are generated, not committed: generated code must match the
# protobuf runtime it runs on (protoc 3.21's output needs python3-protobuf
# >= 3.20), and a committed copy would go stale whenever a .proto changes.
# Packages: protobuf-compiler (protoc), protobuf-compiler-grpc
# (grpc_python_plugin); at run time python3-grpcio and python3-protobuf.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)  # the repository (or its runfiles tree)
out=${1:-$here/gen}

need() {
  command -v "$1" >/dev/null 2>&1 || { echo "gen_stubs.sh: $1 not found (Debian package $2)" >&2; exit 1; }
}
need protoc protobuf-compiler
need grpc_python_plugin protobuf-compiler-grpc
plugin=$(command -v grpc_python_plugin)

mkdir -p "$out"
# The API: package colod.v1, imported as colod/v1/<file>.proto.
protoc -I "$root/proto" --python_out="$out" --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$plugin" "$root"/proto/colod/v1/*.proto
# grpc.health.v1 as the module grpc_health.v1.health_pb2.
protoc -I "$here/proto" --python_out="$out" --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$plugin" "$here/proto/grpc_health/v1/health.proto"
echo "gen_stubs.sh: stubs in $out"
