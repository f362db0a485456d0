"""CUDA detection, the @local_cuda repository, and the cuda_library/cuda_test macros.

CUDA is detected, not assumed. The toolkit root is $COLOD_CUDA_HOME if set (point
it at a missing directory to force a CPU-only build), else $CUDA_HOME, else
/usr/local/cuda. Where <root>/bin/nvcc and the CUDA and NCCL headers and
libraries exist, @local_cuda exposes them and the macros below compile .cu files
with nvcc for sm_80 and sm_90. Where they do not, every CUDA target is marked
incompatible: `bazel build //...` and `bazel test //...` skip it and say so, and
the rest of the tree builds CPU-only.
"""

_ENV = ["COLOD_CUDA_HOME", "CUDA_HOME"]

# Each library is linked by its versioned soname (libcudart.so.13, ...), the
# file a GPU machine's driver stack provides, with an rpath to the toolkit.
_LIBS = {
    "cudart": "libcudart.so",
    "cublas": "libcublas.so",
    "cublasLt": "libcublasLt.so",
    "nccl": "libnccl.so",
}

def _versioned_soname(rctx, libdir, base):
    """Returns e.g. 'libcudart.so.13' for base 'libcudart.so', or None."""
    best = None
    for entry in rctx.path(libdir).readdir():
        name = entry.basename
        if not name.startswith(base + "."):
            continue
        rest = name[len(base) + 1:]
        if rest.isdigit() and (best == None or len(name) < len(best)):
            best = name
    return best

def _cuda_configure_impl(rctx):
    root = rctx.os.environ.get("COLOD_CUDA_HOME") or rctx.os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    nvcc = root + "/bin/nvcc"
    libdir = root + "/lib64"
    missing = []
    for f in [nvcc, root + "/include/cuda_runtime.h", root + "/include/nccl.h", root + "/include/cublas_v2.h"]:
        if not rctx.path(f).exists:
            missing.append(f)
    sonames = {}
    if not missing:
        for name, base in _LIBS.items():
            so = _versioned_soname(rctx, libdir, base)
            if so == None:
                missing.append(libdir + "/" + base + ".<major>")
            else:
                sonames[name] = so

    enabled = not missing
    build = ['package(default_visibility = ["//visibility:public"])', ""]
    linkopts = {}
    if enabled:
        rctx.symlink(root + "/include", "include")

        # For nvcc (bazel/cuda_rules.bzl), whose include flags come from here.
        build.append('cc_library(\n    name = "cuda_headers",\n    hdrs = glob(["include/**"]),\n    includes = ["include"],\n)\n')

        # The header files alone, without an include path (for
        # //bazel:cuda_header_files): C++ targets give the path in their own
        # copts (cuda_private_copts in bazel/cuda_rules.bzl), so it never
        # reaches their dependents.
        build.append('filegroup(\n    name = "headers",\n    srcs = glob(["include/**"]),\n)\n')
        for name, so in sonames.items():
            linkopts[name] = ["-L" + libdir, "-l:" + so, "-Wl,-rpath," + libdir]
            build.append("cc_library(\n    name = %r,\n    deps = [\":cuda_headers\"],\n    linkopts = %r,\n)\n" % (
                name,
                linkopts[name],
            ))
        status = "CUDA found at %s (nvcc, cudart, cuBLAS, NCCL): CUDA targets are built for sm_80 and sm_90." % root
    else:
        print("colod: CUDA not found (%s missing); CUDA and NCCL targets are skipped and the build is CPU-only." % ", ".join(missing))
        for name in ["cuda_headers"] + _LIBS.keys():
            build.append("cc_library(\n    name = %r,\n    target_compatible_with = [\"@colod//bazel:cuda_present\"],\n)\n" % name)
        build.append('filegroup(\n    name = "headers",\n    srcs = [],\n)\n')
        status = "CUDA not found (%s missing): CUDA targets are skipped." % ", ".join(missing)

    rctx.file("BUILD.bazel", "\n".join(build))
    rctx.file("WORKSPACE", 'workspace(name = "local_cuda")\n')
    rctx.file("defs.bzl", "CUDA_ENABLED = %s\nCUDA_ROOT = %r\nNVCC = %r\nCUDA_STATUS = %r\nCUDA_LINKOPTS = %r\n" % (
        enabled,
        root,
        nvcc,
        status,
        linkopts,
    ))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = _ENV,
    local = True,
)
