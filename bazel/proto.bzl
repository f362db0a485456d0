"""cc_grpc_library: C++ protobuf + gRPC code from .proto files, with Debian's protoc.

Bazel 4's native proto rules want a source build of protobuf; this rule runs the
system protoc with the system grpc_cpp_plugin instead. The .proto files' import
root is the package directory: proto/colod/v1/job.proto is imported as
"colod/v1/job.proto" and its C++ header is included as "colod/v1/job.pb.h".
"""

load("//bazel:cc.bzl", "cc_library")

def _gen_impl(ctx):
    pkg = ctx.label.package
    hdrs = []
    srcs = []
    for src in ctx.files.srcs:
        rel = src.short_path[len(pkg) + 1:] if pkg else src.short_path
        stem = rel[:-len(".proto")]
        hdrs += [ctx.actions.declare_file(stem + ext) for ext in [".pb.h", ".grpc.pb.h"]]
        srcs += [ctx.actions.declare_file(stem + ext) for ext in [".pb.cc", ".grpc.pb.cc"]]
    outs = hdrs + srcs
    out_root = ctx.bin_dir.path + ("/" + pkg if pkg else "")
    wkt_root = ctx.files._wkt[0].path.split("/google/protobuf/")[0]
    args = ctx.actions.args()
    args.add("-I" + (pkg if pkg else "."))
    args.add("-I" + wkt_root)
    args.add("--cpp_out=" + out_root)
    args.add("--grpc_out=" + out_root)
    args.add("--plugin=protoc-gen-grpc=" + ctx.executable._plugin.path)
    args.add_all(ctx.files.srcs)
    ctx.actions.run(
        executable = ctx.executable._protoc,
        arguments = [args],
        inputs = ctx.files.srcs + ctx.files._wkt,
        tools = [ctx.executable._plugin],
        outputs = outs,
        mnemonic = "GrpcCodegen",
        progress_message = "protoc %s" % ctx.label,
    )
    return [
        DefaultInfo(files = depset(outs)),
        OutputGroupInfo(hdrs = depset(hdrs), srcs = depset(srcs)),
    ]

_cc_grpc_gen = rule(
    implementation = _gen_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".proto"]),
        "_protoc": attr.label(default = "@system//:bin/protoc", executable = True, cfg = "host", allow_single_file = True),
        "_plugin": attr.label(default = "@system//:bin/grpc_cpp_plugin", executable = True, cfg = "host", allow_single_file = True),
        "_wkt": attr.label(default = "@system//:well_known_protos"),
    },
)

def cc_grpc_library(name, srcs, deps = [], **kwargs):
    """Generates messages and gRPC stubs for srcs and wraps them in a cc_library."""
    _cc_grpc_gen(name = name + "_gen", srcs = srcs)
    native.filegroup(name = name + "_hdrs", srcs = [":" + name + "_gen"], output_group = "hdrs")
    native.filegroup(name = name + "_srcs", srcs = [":" + name + "_gen"], output_group = "srcs")
    cc_library(
        name = name,
        srcs = [":" + name + "_srcs"],
        hdrs = [":" + name + "_hdrs"],
        includes = ["."],
        copts = ["-Wno-unused-parameter"],
        deps = deps + ["@system//:grpc", "@system//:protobuf"],
        **kwargs
    )
