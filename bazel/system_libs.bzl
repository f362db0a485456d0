"""Exposes Debian's system libraries as the repository @system.

Each library becomes a cc_library that carries only link options: the headers
live under /usr/include, which the C++ toolchain already treats as a builtin
include directory. Link flags come from pkg-config where Debian ships a .pc file.
A missing header, library or tool fails the build with the Debian package that
provides it, so `bazel build` on a machine without ./dev setup says what to do.
"""

# name -> (probe file, Debian package, pkg-config modules or None, extra linkopts)
_LIBS = {
    "absl": ("/usr/include/absl/status/statusor.h", "libabsl-dev", [
        "absl_status",
        "absl_statusor",
        "absl_strings",
        "absl_str_format",
        "absl_synchronization",
        "absl_time",
        "absl_flags",
        "absl_flags_parse",
        "absl_flags_usage",
        "absl_random_random",
        "absl_hash",
        "absl_raw_hash_set",
        "absl_cord",
    ], []),
    "protobuf": ("/usr/include/google/protobuf/message.h", "libprotobuf-dev", ["protobuf"], []),
    "grpc": ("/usr/include/grpcpp/grpcpp.h", "libgrpc++-dev", ["grpc++"], ["-lgrpc++_reflection"]),
    "prometheus": ("/usr/include/prometheus/exposer.h", "prometheus-cpp-dev", ["prometheus-cpp-pull", "prometheus-cpp-core"], ["-lcivetweb-cpp", "-lcivetweb"]),
    "gtest": ("/usr/include/gtest/gtest.h", "libgtest-dev", ["gtest"], []),
    "gtest_main": ("/usr/include/gtest/gtest.h", "libgtest-dev", ["gtest_main"], []),
    "gmock": ("/usr/include/gmock/gmock.h", "libgmock-dev", ["gmock"], []),
    "gloo": ("/usr/include/gloo/context.h", "libgloo-dev", None, ["-lgloo", "-lpthread"]),
    "json": ("/usr/include/nlohmann/json.hpp", "nlohmann-json3-dev", None, []),
    "yaml": ("/usr/include/yaml-cpp/yaml.h", "libyaml-cpp-dev", ["yaml-cpp"], []),
    "openblas": ("/usr/include/x86_64-linux-gnu/cblas.h", "libopenblas-dev", ["openblas"], []),
    # Only colod-sentencepiece links it (worker/train/sentencepiece_helper.cc
    # says why); pkg-config would add the trainer library too.
    "sentencepiece": ("/usr/include/sentencepiece_processor.h", "libsentencepiece-dev", None, ["-lsentencepiece"]),
    "sentencepiece_train": ("/usr/include/sentencepiece_trainer.h", "libsentencepiece-dev", None, ["-lsentencepiece_train", "-lsentencepiece"]),
    "icu": ("/usr/include/unicode/uchar.h", "libicu-dev", ["icu-uc"], []),
    "crypto": ("/usr/include/openssl/evp.h", "libssl-dev", ["libcrypto"], []),
}

_TOOLS = {
    "protoc": ("/usr/bin/protoc", "protobuf-compiler"),
    "grpc_cpp_plugin": ("/usr/bin/grpc_cpp_plugin", "protobuf-compiler-grpc"),
}

def _fail_missing(path, package):
    fail("colod: %s not found; install the Debian package '%s' (./dev setup does)." % (path, package))

def _pkg_config(rctx, modules, package):
    res = rctx.execute(["pkg-config", "--libs"] + modules)
    if res.return_code != 0:
        fail("colod: pkg-config --libs %s failed (%s); install '%s' and pkg-config." %
             (" ".join(modules), res.stderr.strip(), package))
    out = []
    for flag in res.stdout.strip().split(" "):
        # Keep the first occurrence of each flag; pkg-config repeats Abseil's base libraries.
        # --push-state/--pop-state pairs must keep their order, so they are never deduplicated.
        if flag == "" or (flag in out and flag.startswith("-l")):
            continue
        out.append(flag)
    return out

def _system_libs_impl(rctx):
    build = ['package(default_visibility = ["//visibility:public"])', ""]
    for name, (probe, package, modules, extra) in _LIBS.items():
        if not rctx.path(probe).exists:
            _fail_missing(probe, package)
        linkopts = (_pkg_config(rctx, modules, package) if modules else []) + extra
        build.append("cc_library(\n    name = %r,\n    linkopts = %r,\n)\n" % (name, linkopts))

    for name, (path, package) in _TOOLS.items():
        if not rctx.path(path).exists:
            _fail_missing(path, package)
        rctx.symlink(path, "bin/" + name)
        build.append("exports_files([%r])\n" % ("bin/" + name))
        build.append("alias(name = %r, actual = %r)\n" % (name, "bin/" + name))

    # The well-known .proto files (empty, timestamp, duration, struct, ...) for protoc's -I.
    wkt = "/usr/include/google/protobuf"
    if not rctx.path(wkt + "/empty.proto").exists:
        _fail_missing(wkt + "/empty.proto", "libprotobuf-dev")
    rctx.symlink(wkt, "include/google/protobuf")
    build.append('filegroup(\n    name = "well_known_protos",\n    srcs = glob(["include/google/protobuf/*.proto", "include/google/protobuf/compiler/*.proto"]),\n)\n')
    rctx.file("BUILD.bazel", "\n".join(build))
    rctx.file("WORKSPACE", 'workspace(name = "system")\n')

system_libs = repository_rule(
    implementation = _system_libs_impl,
    local = True,
    doc = "Debian system libraries (gRPC, protobuf, Abseil, prometheus-cpp, GoogleTest, Gloo, OpenBLAS, nlohmann-json, yaml-cpp, ICU) and protoc.",
)
