"""colod's cc_library, cc_test and cc_binary: Bazel's, starting from a precompiled header.

Every BUILD file loads these instead of the native rules. Each C++ compile of
a target is given `-include bazel/pch/<set>_pch.h`, where <set> is `test` for
tests and testonly targets and `library` for the rest (bazel/pch/*.h list the
headers). `cc_pch` compiles that list once per configuration, with the
toolchain's command line for a C++ compile and the build's --copt/--cxxopt, so
the precompiled header takes the same flags as the compiles that use it:

  * `<set>_pch.h.gch/o2.h`: at the build's flags;
  * `<set>_pch.h.gch/o0.h`: the same with `-O0`, the test files' level
    (`--per_file_copt=.*_test\\.cc@-O0` in .bazelrc);
  * under `-c opt`, where Bazel compiles each library twice, also
    `o2_nopic.h` and `o0_nopic.h`, without `-fPIC`.

gcc looks for `NAME.gch` before `NAME` in each include directory and takes
the first file in a `.gch` directory that was compiled with flags compatible
with the compile at hand (the `-O` level, `-fPIC`, sanitizers, `-g`, the
macros the headers test). The file names end in `.h` only to pass as a
cc_library's headers, which makes them inputs of every compile that needs
them. `<set>_pch.h` itself exists only in the output tree, so `-include`
finds it and its `.gch` there, never a source file of that name.

Where no variant fits a compile, gcc reads `<set>_pch.h` as text, and the
text is an `#error` that says why: a compile that silently parsed the
headers again would cost what the precompiled header saves, and no log
check sees the compiles Bazel has cached. A target whose own copts set `-O`
or `-f` flags gets no precompiled header (kernels/cpu's `-O3`), nor does
one with a C source, and `pch = False` does the same by hand; both tag it `no_pch`, and `./dev
deps-check` finds any other C++ target with sources that has none (a BUILD
file that loads the native rules).

Where the C++ compiler is clang (the asan pass) or with
`--define=colod_pch=off`, `<set>_pch.h` is empty and nothing is
precompiled: every file then includes exactly what it names, which is also
how to check that none relies on the precompiled header's includes.

Bazel tracks no system header (bazel/system_libs.bzl): after upgrading gcc
or a -dev package, `bazel clean`, as before there were precompiled headers
(gcc refuses a PCH from another gcc, and the `#error` says so).
docs/TESTING.md has the measurements.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")
load("@bazel_tools//tools/build_defs/cc:action_names.bzl", "CPP_COMPILE_ACTION_NAME")

# Precompiled header variants: file name -> (flags added to the build's, PIC).
_VARIANTS = {
    "o2.h": ([], True),
    "o0.h": (["-O0"], True),
}

# Under -c opt Bazel also compiles every library without -fPIC (for the
# statically linked binaries), which no PIC variant fits.
_NOPIC_VARIANTS = {
    "o2_nopic.h": ([], False),
    "o0_nopic.h": (["-O0"], False),
}

_FALLBACK_ERROR = " ".join([
    "colod: no precompiled header fits this compile (bazel/cc.bzl).",
    "A -O, -f, -g or -D flag of the target or file differs from the build's,",
    "or gcc was upgraded since the header was precompiled (then: bazel clean).",
    "Give the target pch = False, or build with --define=colod_pch=off.",
])

def _cc_pch_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    header = ctx.actions.declare_file(ctx.label.name + "_pch.h")
    src = ctx.file.src
    # Bazel's autoconfigured toolchain calls gcc "compiler"; clang reads no gcc PCH.
    enabled = ctx.attr.enabled and cc_toolchain.compiler != "clang"
    if not enabled:
        ctx.actions.write(header, "// colod: no precompiled header in this build (bazel/cc.bzl).\n")
        return [
            DefaultInfo(files = depset([header])),
            CcInfo(compilation_context = cc_common.create_compilation_context(headers = depset([header]))),
        ]

    # The text gcc reads where no precompiled variant fits the compile.
    ctx.actions.write(header, "\n".join([
        "// colod's precompiled header %s, as text (bazel/cc.bzl): gcc reads" % ctx.label,
        "// this only where no precompiled variant fits the compile.",
        "#error \"%s\"" % _FALLBACK_ERROR,
        "",
    ]))
    feature_configuration = cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )
    compiler = cc_common.get_tool_for_action(
        feature_configuration = feature_configuration,
        action_name = CPP_COMPILE_ACTION_NAME,
    )
    variants = dict(_VARIANTS)
    if ctx.var["COMPILATION_MODE"] == "opt":
        variants.update(_NOPIC_VARIANTS)
    outputs = [header]
    for name, (extra_flags, pic) in variants.items():
        out = ctx.actions.declare_file("%s_pch.h.gch/%s" % (ctx.label.name, name))
        variables = cc_common.create_compile_variables(
            cc_toolchain = cc_toolchain,
            feature_configuration = feature_configuration,
            user_compile_flags = ctx.fragments.cpp.copts + ctx.fragments.cpp.cxxopts + extra_flags,
            use_pic = pic,
        )
        command_line = cc_common.get_memory_inefficient_command_line(
            feature_configuration = feature_configuration,
            action_name = CPP_COMPILE_ACTION_NAME,
            variables = variables,
        )
        env = cc_common.get_environment_variables(
            feature_configuration = feature_configuration,
            action_name = CPP_COMPILE_ACTION_NAME,
            variables = variables,
        )
        args = ctx.actions.args()
        args.add_all(command_line)
        args.add_all(["-c", "-x", "c++-header", src.path, "-o", out.path])
        ctx.actions.run(
            executable = compiler,
            arguments = [args],
            env = env,
            inputs = depset(ctx.files.hdrs + [src], transitive = [cc_toolchain.all_files]),
            outputs = [out],
            mnemonic = "CppPch",
            progress_message = "Precompiling %s (%s)" % (src.short_path, name[:-len(".h")]),
        )
        outputs.append(out)
    return [
        DefaultInfo(files = depset(outputs)),
        CcInfo(compilation_context = cc_common.create_compilation_context(headers = depset(outputs))),
    ]

cc_pch = rule(
    implementation = _cc_pch_impl,
    attrs = {
        "src": attr.label(allow_single_file = [".h"], mandatory = True, doc = "The header to precompile."),
        "hdrs": attr.label_list(allow_files = [".h"], doc = "Headers `src` includes."),
        "enabled": attr.bool(default = True),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    fragments = ["cpp"],
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    doc = "`NAME_pch.h`, and `src` precompiled for it with the build's flags (module docstring).",
)

def _with_pch(kind, srcs, copts, deps, tags, pch):
    """copts, deps and tags of a target that starts from the `kind` precompiled header."""
    if type(srcs) == type([]) and not srcs:
        return copts, deps, tags

    # A target's own -O or -f flags would make every variant unusable; a
    # select() of copts holds only include paths, warnings and -include here
    # (bazel/cuda_rules.bzl).
    if type(copts) == type([]) and [c for c in copts if c.startswith("-O") or c.startswith("-f")]:
        pch = False

    # A C source cannot include the C++ headers.
    if type(srcs) == type([]) and [s for s in srcs if type(s) == type("") and s.endswith(".c")]:
        pch = False
    if not pch:
        return copts, deps, tags + ["no_pch"]
    return ["-include", "bazel/pch/%s_pch.h" % kind] + copts, deps + ["//bazel/pch:" + kind], tags

def cc_library(name, srcs = [], copts = [], deps = [], tags = [], testonly = None, pch = True, **kwargs):
    """Bazel's cc_library, from the library (or, if testonly, the test) precompiled header."""
    copts, deps, tags = _with_pch("test" if testonly else "library", srcs, copts, deps, tags, pch)
    native.cc_library(name = name, srcs = srcs, copts = copts, deps = deps, tags = tags, testonly = testonly, **kwargs)

def cc_binary(name, srcs = [], copts = [], deps = [], tags = [], testonly = None, pch = True, **kwargs):
    """Bazel's cc_binary, from the library (or, if testonly, the test) precompiled header."""
    copts, deps, tags = _with_pch("test" if testonly else "library", srcs, copts, deps, tags, pch)
    native.cc_binary(name = name, srcs = srcs, copts = copts, deps = deps, tags = tags, testonly = testonly, **kwargs)

def cc_test(name, srcs = [], copts = [], deps = [], tags = [], pch = True, **kwargs):
    """Bazel's cc_test, from the test precompiled header."""
    copts, deps, tags = _with_pch("test", srcs, copts, deps, tags, pch)
    native.cc_test(name = name, srcs = srcs, copts = copts, deps = deps, tags = tags, **kwargs)
