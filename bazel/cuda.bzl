"""CUDA detection, the @local_cuda repository, and the cuda_library/cuda_test macros.

CUDA is detected, not assumed. The toolkit root is $COLOD_CUDA_HOME if set (point
it at a missing directory to force a CPU-only build), else $CUDA_HOME, else
/usr/local/cuda. Where <root>/bin/nvcc and the CUDA and NCCL headers and
libraries exist, @local_cuda exposes them and the macros below compile .cu files
with nvcc for the GPU architectures $COLOD_CUDA_ARCHS lists (default "80 90":
sm_80 and sm_90, with compute_90 PTX for newer GPUs). Where they do not, every CUDA target is marked
incompatible: `bazel build //...` and `bazel test //...` skip it and say so, and
the rest of the tree builds CPU-only.
"""

_ENV = ["COLOD_CUDA_HOME", "CUDA_HOME", "CC", "COLOD_CUDA_ARCHS"]

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

# The toolkit headers colod's C++ (not .cu) sources include: the CUDA
# library targets (cuda_cc_library, cuda_cc_test, cuda_library's cc_srcs)
# compile with the toolkit's include directory. A source that includes
# another one adds it here; otherwise the build fails on it ("No such file"
# in the sandbox, or an undeclared inclusion).
_CXX_INCLUDES = [
    "cublasLt.h",
    "cublas_v2.h",
    "cuda_bf16.h",
    "cuda_fp16.h",
    "cuda_runtime.h",
    "cuda_runtime_api.h",
    "cudnn.h",
    "library_types.h",
    "nccl.h",
]

def _normalize(path):
    """path without "." and ".." segments (gcc -M keeps those of the #include)."""
    out = []
    for part in path.split("/"):
        if part == "..":
            if out:
                out.pop()
        elif part and part != ".":
            out.append(part)
    return "/".join(out)

def _cxx_headers(rctx, root):
    """The files under root/include that _CXX_INCLUDES reach, relative to it (the
    host compiler's -M), or None where that fails: then the whole tree."""
    cc = rctx.os.environ.get("CC") or "gcc"
    rctx.file("cxx_includes_probe.cc", "".join(["#include <%s>\n" % h for h in _CXX_INCLUDES]))
    probe = [cc, "-M", "-x", "c++", "-std=c++17", "-isystem", root + "/include", "cxx_includes_probe.cc"]

    # The paths as included, not shortened to their real ones (gcc's default
    # for system headers), as Bazel's own compiles do; clang has no such flag.
    result = rctx.execute(probe[:1] + ["-fno-canonical-system-headers"] + probe[1:])
    if result.return_code != 0:
        result = rctx.execute(probe)
    rctx.delete("cxx_includes_probe.cc")
    if result.return_code != 0:
        print("colod: listing the CUDA headers with %s -M failed (%s); every toolkit header is an input of the CUDA targets' dependents" % (cc, result.stderr.strip()[:300]))
        return None
    prefix = _normalize(root + "/include") + "/"
    headers = {}
    for token in result.stdout.replace("\\\n", " ").replace("\n", " ").split(" "):
        if not token:
            continue
        path = "/" + _normalize(token)
        if path.startswith("/" + prefix):
            headers[path[len(prefix) + 1:]] = True
    for h in _CXX_INCLUDES:
        if h not in headers:
            print("colod: %s is not under %s/include; every toolkit header is an input of the CUDA targets' dependents" % (h, root))
            return None
    return sorted(headers.keys())

# The compute capabilities nvcc compiles for where $COLOD_CUDA_ARCHS is unset:
# Ampere and Hopper. colod's kernels need sm_80 (bf16 mma.sync, cp.async).
_DEFAULT_ARCHS = "80 90"

def _gencode(archs):
    """nvcc's -gencode flags for $COLOD_CUDA_ARCHS (compute capabilities such as
    "80 90" or "90,100"): SASS for each, and PTX of the newest, which newer GPUs
    compile when they load it. fail()s on anything else."""
    caps = []
    for word in archs.replace(",", " ").split(" "):
        if not word:
            continue
        if not word.isdigit() or len(word) > 3 or int(word) < 80:
            fail("COLOD_CUDA_ARCHS=%r: %r is not a compute capability of 80 or more (written as 80, 90, 100: colod's kernels need sm_80)" % (archs, word))
        if int(word) not in caps:
            caps.append(int(word))
    if not caps:
        fail("COLOD_CUDA_ARCHS=%r names no GPU architecture (e.g. \"80 90\")" % archs)
    caps = sorted(caps)
    flags = ["-gencode=arch=compute_%d,code=sm_%d" % (c, c) for c in caps[:-1]]
    flags.append("-gencode=arch=compute_%d,code=[sm_%d,compute_%d]" % (caps[-1], caps[-1], caps[-1]))
    return caps, flags

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
    caps, gencode = [], []
    if enabled:  # a CPU-only build ignores COLOD_CUDA_ARCHS
        caps, gencode = _gencode(rctx.os.environ.get("COLOD_CUDA_ARCHS") or _DEFAULT_ARCHS)
    build = ['package(default_visibility = ["//visibility:public"])', ""]
    linkopts = {}
    if enabled:
        rctx.symlink(root + "/include", "include")

        # For nvcc (bazel/cuda_rules.bzl), whose include flags come from here.
        build.append('cc_library(\n    name = "cuda_headers",\n    hdrs = glob(["include/**"]),\n    includes = ["include"],\n)\n')

        # The header files alone, without an include path (for
        # //bazel:cuda_header_files): C++ targets give the path in their own
        # copts (cuda_private_copts in bazel/cuda_rules.bzl), so it never
        # reaches their dependents. Only those the C++ sources can reach
        # (_cxx_headers): every compile action that depends on a CUDA library
        # has them as inputs, and the toolkit's whole tree (about 2,000 files)
        # cost each of those actions 3 s of sandbox setup on two cores.
        headers = _cxx_headers(rctx, root)
        build.append("filegroup(\n    name = \"headers\",\n    srcs = %s,\n)\n" % (
            'glob(["include/**"])' if headers == None else repr(["include/" + h for h in headers])
        ))
        for name, so in sonames.items():
            linkopts[name] = ["-L" + libdir, "-l:" + so, "-Wl,-rpath," + libdir]
            build.append("cc_library(\n    name = %r,\n    deps = [\":cuda_headers\"],\n    linkopts = %r,\n)\n" % (
                name,
                linkopts[name],
            ))
        status = "CUDA found at %s (nvcc, cudart, cuBLAS, NCCL): CUDA targets are built for %s." % (
            root,
            ", ".join(["sm_%d" % c for c in caps]),
        )
    else:
        print("colod: CUDA not found (%s missing); CUDA and NCCL targets are skipped and the build is CPU-only." % ", ".join(missing))
        for name in ["cuda_headers"] + _LIBS.keys():
            build.append("cc_library(\n    name = %r,\n    target_compatible_with = [\"@colod//bazel:cuda_present\"],\n)\n" % name)
        build.append('filegroup(\n    name = "headers",\n    srcs = [],\n)\n')
        status = "CUDA not found (%s missing): CUDA targets are skipped." % ", ".join(missing)

    rctx.file("BUILD.bazel", "\n".join(build))
    rctx.file("WORKSPACE", 'workspace(name = "local_cuda")\n')
    rctx.file("defs.bzl", "CUDA_ENABLED = %s\nCUDA_ROOT = %r\nNVCC = %r\nCUDA_STATUS = %r\nCUDA_LINKOPTS = %r\nCUDA_GENCODE = %r\n" % (
        enabled,
        root,
        nvcc,
        status,
        linkopts,
        gencode,
    ))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = _ENV,
    local = True,
)
