"""cuda_library and cuda_test: nvcc-compiled CUDA code that is skipped without CUDA."""

load("@local_cuda//:defs.bzl", "CUDA_ENABLED", "NVCC")

# Ampere and Hopper; compute_90 PTX rides along for newer GPUs.
CUDA_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
]

# A constraint no platform has: a target that requires it is incompatible.
_INCOMPATIBLE = ["//bazel:cuda_present"]

def _cuda_objects_impl(ctx):
    cc_infos = [d[CcInfo] for d in ctx.attr.deps if CcInfo in d]
    headers = depset(ctx.files.hdrs, transitive = [c.compilation_context.headers for c in cc_infos])
    include_flags = ["-I.", "-I" + ctx.bin_dir.path]
    for c in cc_infos:
        cc = c.compilation_context
        for d in cc.includes.to_list() + cc.quote_includes.to_list() + cc.system_includes.to_list():
            include_flags.append("-I" + d)
    outs = []
    for src in ctx.files.srcs:
        out = ctx.actions.declare_file("_cuda_objs/%s/%s.o" % (ctx.label.name, src.basename[:-len(".cu")]))
        args = ctx.actions.args()
        args.add_all(["-c", src.path, "-o", out.path, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-lineinfo"])
        args.add_all(CUDA_GENCODE)
        args.add_all(include_flags)
        args.add_all(ctx.attr.copts)
        ctx.actions.run(
            executable = ctx.attr.nvcc,
            arguments = [args],
            inputs = depset([src], transitive = [headers]),
            outputs = [out],
            mnemonic = "Nvcc",
            progress_message = "nvcc %s" % src.short_path,
            env = {"PATH": "/usr/bin:/bin"},
        )
        outs.append(out)
    return [DefaultInfo(files = depset(outs))]

_cuda_objects = rule(
    implementation = _cuda_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = True),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "nvcc": attr.string(),
    },
)

def cuda_library(name, srcs = [], hdrs = [], deps = [], copts = [], cc_srcs = [], **kwargs):
    """A cc_library whose .cu srcs are compiled by nvcc; cc_srcs are compiled by the C++ toolchain."""
    compat = [] if CUDA_ENABLED else _INCOMPATIBLE
    all_deps = deps + ["@local_cuda//:cudart", "@local_cuda//:cuda_headers"]
    _cuda_objects(
        name = name + "_cuda_objs",
        srcs = srcs,
        hdrs = hdrs,
        deps = all_deps,
        copts = copts,
        nvcc = NVCC,
        target_compatible_with = compat,
    )
    native.cc_library(
        name = name,
        srcs = [":" + name + "_cuda_objs"] + cc_srcs,
        hdrs = hdrs,
        deps = all_deps,
        target_compatible_with = compat,
        **kwargs
    )

def cuda_cc_test(name, deps = [], **kwargs):
    """A cc_test that needs the CUDA toolkit to build (it skips at run time without a GPU)."""
    native.cc_test(
        name = name,
        deps = deps,
        target_compatible_with = [] if CUDA_ENABLED else _INCOMPATIBLE,
        **kwargs
    )

def cuda_cc_library(name, deps = [], **kwargs):
    """A C++ (not .cu) library that links CUDA libraries, e.g. the NCCL communicator."""
    native.cc_library(
        name = name,
        deps = deps,
        target_compatible_with = [] if CUDA_ENABLED else _INCOMPATIBLE,
        **kwargs
    )
