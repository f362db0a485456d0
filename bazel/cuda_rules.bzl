"""cuda_library and friends: CUDA code built by nvcc, or by the host compiler
against colod's CUDA emulation under --config=cuda-emu, and skipped where
neither is available.

Without the toolkit (bazel/cuda.bzl) every CUDA target is incompatible and
skipped, unless --config=cuda-emu is set: the emulation needs no toolkit.
"""

load("@local_cuda//:defs.bzl", "CUDA_ENABLED", "NVCC")

# Ampere and Hopper; compute_90 PTX rides along for newer GPUs.
CUDA_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
]

# A constraint no platform has: a target that requires it is incompatible.
_INCOMPATIBLE = ["//bazel:cuda_present"]

_EMU = "//bazel:cuda_emu"

def cuda_compatible():
    """target_compatible_with for targets that need CUDA (the toolkit or the emulation)."""
    return select({
        _EMU: [],
        "//conditions:default": [] if CUDA_ENABLED else _INCOMPATIBLE,
    })

def if_cuda(if_true, if_false = []):
    """`if_true` where the build has CUDA (the toolkit or the emulation), else `if_false`."""
    return select({
        _EMU: if_true,
        "//conditions:default": if_true if CUDA_ENABLED else if_false,
    })

def cuda_defines():
    """local_defines for code with CUDA parts behind #ifdef COLOD_WITH_CUDA."""
    return if_cuda(["COLOD_WITH_CUDA"])

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
    """A cc_library whose .cu srcs are compiled by nvcc (or, under --config=cuda-emu, by
    the host compiler against the emulation); cc_srcs are compiled by the C++ toolchain."""
    all_deps = deps + ["//bazel:cudart", "//bazel:cuda_headers"]
    _cuda_objects(
        name = name + "_cuda_objs",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart", "@local_cuda//:cuda_headers"],
        copts = copts,
        nvcc = NVCC,
        target_compatible_with = select({
            _EMU: _INCOMPATIBLE,
            "//conditions:default": [] if CUDA_ENABLED else _INCOMPATIBLE,
        }),
        tags = ["manual"],
    )

    # The same sources as C++ for the emulation: foo.cu is copied to foo.cu.cc.
    emu_srcs = [src + ".cc" for src in srcs]
    native.genrule(
        name = name + "_emu_srcs",
        srcs = srcs,
        outs = emu_srcs,
        cmd = " && ".join(["cp $(location %s) $(location %s)" % (s, s + ".cc") for s in srcs]),
        tags = ["manual"],
    )
    native.cc_library(
        name = name,
        srcs = select({
            _EMU: [":" + name + "_emu_srcs"],
            "//conditions:default": [":" + name + "_cuda_objs"],
        }) + cc_srcs,
        hdrs = hdrs,
        copts = select({
            # nvcc includes cuda_runtime.h implicitly; `#pragma unroll` is
            # nvcc's own (the host compiler unrolls as it sees fit).
            _EMU: ["-include", "cuda_runtime.h", "-Wno-unknown-pragmas"],
            "//conditions:default": [],
        }),
        deps = all_deps,
        target_compatible_with = cuda_compatible(),
        **kwargs
    )

def cuda_cc_test(name, deps = [], tags = [], **kwargs):
    """A cc_test that needs CUDA to build (it skips at run time without a GPU; under
    --config=cuda-emu it runs on the emulation). Tagged "gpu": ./dev gpu-check runs
    every test so tagged on the real devices."""
    native.cc_test(
        name = name,
        deps = deps,
        tags = tags + ["gpu"],
        target_compatible_with = cuda_compatible(),
        **kwargs
    )

def cuda_cc_library(name, deps = [], **kwargs):
    """A C++ (not .cu) library that links CUDA libraries, e.g. the NCCL communicator."""
    native.cc_library(
        name = name,
        deps = deps,
        target_compatible_with = cuda_compatible(),
        **kwargs
    )
