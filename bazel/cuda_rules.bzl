"""cuda_library and friends: CUDA code built by nvcc, or by the host compiler
against colod's CUDA emulation under --config=cuda-emu, and left out where
neither is available (or under --config=no-cuda).

Without the toolkit (bazel/cuda.bzl) no CUDA source is compiled, unless
--config=cuda-emu is set: the emulation needs no toolkit.

One dependency graph for every build. A CUDA library (cuda_library,
cuda_cc_library) is a dependency in every build, with the same headers; only
its sources are left out, and it links nothing, where the build has no CUDA.
CUDA tests (cuda_cc_test) are incompatible there and skipped. The CUDA
include path is private: a target whose own sources include CUDA, cuBLAS or
NCCL headers names it in its own copts (cuda_private_copts; every
cuda_library, cuda_cc_library and cuda_cc_test does), which Bazel does not
pass on, and the header files themselves, the toolkit's and the emulation's
together, are in every build's graph (//bazel:cuda_header_files). So every
other target's compile action, whose key holds its command and the list of
headers it may include, is the same in the default build, under
--config=cuda-emu and under --config=no-cuda, and the three share it instead
of compiling the tree once each. A header that other targets include must
not include CUDA's.
"""

# CUDA_GENCODE: the GPU architectures of $COLOD_CUDA_ARCHS (bazel/cuda.bzl;
# by default sm_80 and sm_90, with compute_90 PTX for newer GPUs).
load("@local_cuda//:defs.bzl", "CUDA_ENABLED", "CUDA_GENCODE", "NVCC")
load("//bazel:cc.bzl", "cc_library", "cc_test")

# A constraint no platform has: a target that requires it is incompatible.
_INCOMPATIBLE = ["//bazel:cuda_present"]

_EMU = "//bazel:cuda_emu"
_NONE = "//bazel:cuda_none"

def cuda_compatible():
    """target_compatible_with for targets that need CUDA to run (the toolkit or the
    emulation): tests and binaries."""
    return select({
        _EMU: [],
        _NONE: _INCOMPATIBLE,
        "//conditions:default": [] if CUDA_ENABLED else _INCOMPATIBLE,
    })

def cuda_toolkit_compatible():
    """target_compatible_with for targets that need the real toolkit (neither the
    emulation nor a CPU-only build): cuDNN's."""
    return select({
        _EMU: _INCOMPATIBLE,
        _NONE: _INCOMPATIBLE,
        "//conditions:default": [] if CUDA_ENABLED else _INCOMPATIBLE,
    })

def if_cuda(if_true, if_false = []):
    """`if_true` where the build has CUDA (the toolkit or the emulation), else `if_false`."""
    return select({
        _EMU: if_true,
        _NONE: if_false,
        "//conditions:default": if_true if CUDA_ENABLED else if_false,
    })

def cuda_defines():
    """local_defines for code with CUDA parts behind #ifdef COLOD_WITH_CUDA."""
    return if_cuda(["COLOD_WITH_CUDA"])

def cuda_private_copts():
    """copts of a target whose own sources include CUDA, cuBLAS or NCCL headers:
    their directory (the toolkit's or the emulation's) as -isystem, which
    dependents do not inherit. Goes with cuda_private_deps()."""
    return select({
        _EMU: ["-isystem", "kernels/cuda/emu/include"],
        _NONE: [],
        "//conditions:default": ["-isystem", "external/local_cuda/include"] if CUDA_ENABLED else [],
    })

def cuda_private_deps():
    """deps of such a target: the CUDA header files, without an include path."""
    return ["//bazel:cuda_header_files"]

def _cuda_link_only_impl(ctx):
    return [CcInfo(linking_context = ctx.attr.library[CcInfo].linking_context)]

cuda_link_only = rule(
    implementation = _cuda_link_only_impl,
    attrs = {"library": attr.label(providers = [CcInfo])},
    doc = """What linking `library` brings (its objects, shared libraries and linkopts)
without its headers or include paths: the emulation's libraries as dependents see
them, like the toolkit's, which have no headers in the graph either.""",
)

def _cuda_objects_impl(ctx):
    cc_infos = [d[CcInfo] for d in ctx.attr.deps if CcInfo in d]

    # Not the precompiled headers of the C++ compiles (bazel/cc.bzl): nvcc
    # reads none, and as inputs they would rerun nvcc whenever they change.
    headers = depset(ctx.files.hdrs + [
        h
        for c in cc_infos
        for h in c.compilation_context.headers.to_list()
        if h.owner == None or h.owner.package != "bazel/pch"
    ])
    include_flags = ["-I.", "-I" + ctx.bin_dir.path]
    for c in cc_infos:
        cc = c.compilation_context
        for d in cc.includes.to_list() + cc.quote_includes.to_list() + cc.system_includes.to_list():
            include_flags.append("-I" + d)
    outs = []
    for src in ctx.files.srcs:
        # Each object in a directory of its own, which is also nvcc's
        # temporary directory (TMPDIR, and --objdir-as-tempdir for the
        # intermediate files): in the sandbox every nvcc is pid 2, and nvcc
        # names its files in a shared /tmp by pid, so two concurrent compiles
        # removed or overwrote each other's files ("cannot open module id
        # file /tmp/tmpxft_00000002_...").
        stem = src.basename[:-len(".cu")]
        out = ctx.actions.declare_file("_cuda_objs/%s/%s/%s.o" % (ctx.label.name, stem, stem))
        args = ctx.actions.args()
        args.add_all(["-c", src.path, "-o", out.path, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-lineinfo"])
        args.add("--objdir-as-tempdir")
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
            env = {"PATH": "/usr/bin:/bin", "TMPDIR": out.dirname},
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
    the host compiler against the emulation); cc_srcs are compiled by the C++ toolchain.
    Where the build has no CUDA it has only its headers."""
    _cuda_objects(
        name = name + "_cuda_objs",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart", "@local_cuda//:cuda_headers"],
        copts = copts,
        nvcc = NVCC,
        target_compatible_with = select({
            _EMU: _INCOMPATIBLE,
            _NONE: _INCOMPATIBLE,
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
    cc_library(
        name = name,
        srcs = select({
            _EMU: [":" + name + "_emu_srcs"] + cc_srcs,
            _NONE: [],
            "//conditions:default": [":" + name + "_cuda_objs"] + cc_srcs if CUDA_ENABLED else [],
        }),
        hdrs = hdrs,
        copts = cuda_private_copts() + select({
            # nvcc includes cuda_runtime.h implicitly; `#pragma unroll` is
            # nvcc's own (the host compiler unrolls as it sees fit).
            _EMU: ["-include", "cuda_runtime.h", "-Wno-unknown-pragmas"],
            "//conditions:default": [],
        }),
        deps = deps + ["//bazel:cudart"] + cuda_private_deps(),
        **kwargs
    )

def cuda_cc_library(name, srcs = [], deps = [], copts = [], **kwargs):
    """A C++ (not .cu) library with CUDA code, e.g. the NCCL communicator. Its
    sources may include CUDA headers; where the build has no CUDA it has only its
    headers. Its public headers are included with the CUDA include path only by
    targets that add it themselves."""
    cc_library(
        name = name,
        srcs = if_cuda(srcs),
        deps = deps + cuda_private_deps(),
        copts = copts + cuda_private_copts(),
        **kwargs
    )

def cuda_cc_test(name, deps = [], copts = [], tags = [], **kwargs):
    """A cc_test that needs CUDA to build (it skips at run time without a GPU; under
    --config=cuda-emu it runs on the emulation). Tagged "gpu": ./dev gpu-check runs
    every test so tagged on the real devices. Its sources may include CUDA headers."""
    cc_test(
        name = name,
        deps = deps + cuda_private_deps(),
        copts = copts + cuda_private_copts(),
        tags = tags + ["gpu"],
        target_compatible_with = cuda_compatible(),
        **kwargs
    )
