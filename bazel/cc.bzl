"""colod's cc_library, cc_test and cc_binary: Bazel's, starting from a precompiled header.

Every BUILD file loads these instead of the native rules. Each C++ compile of
a target is given `-include bazel/pch/<set>_pch.h`, where <set> is `test` for
tests and testonly targets and `library` for the rest (bazel/pch/*.h list the
headers). `cc_pch` compiles that list once per configuration, with the
toolchain's command line for a C++ compile and the build's --copt/--cxxopt, so
the precompiled header takes the same flags as the compiles that use it:

  * `<set>_pch.h.gch/o2.h`: at the build's flags;
  * `<set>_pch.h.gch/o0.h`: the same with `-O0`, the test files' level
    (`--per_file_copt=.*_test\\.cc@-O0` in .bazelrc).

gcc looks for `NAME.gch` before `NAME` in each include directory and takes
the first file in a `.gch` directory that was compiled with flags compatible
with the compile at hand (the `-O` level, `-fPIC`, sanitizers, the macros
the headers test). The file names end in `.h` only to pass as a
cc_library's headers, which makes them inputs of every compile that needs
them. `<set>_pch.h` itself exists only in the output tree, so `-include`
finds it and its `.gch` there, never a source file of that name.

Where no precompiled header fits a compile (a target's own `-O3`, say),
gcc reads `<set>_pch.h` as text: it includes the same headers, so the file
still compiles, and it warns "colod: the precompiled header was not used",
which `./dev test` counts as a failure of the build's speed, not its
correctness. A target whose copts set `-O` or `-f` flags gets no
precompiled header (`pch = False` does the same by hand).

Where the C++ compiler is not gcc (the asan pass's clang) or with
`--define=colod_pch=off`, `<set>_pch.h` is empty and nothing is
precompiled: every file then includes exactly what it names, which is also
how to check that none relies on the precompiled header's includes.
docs/TESTING.md has the measurements.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")
load("@bazel_tools//tools/build_defs/cc:action_names.bzl", "CPP_COMPILE_ACTION_NAME")

# Precompiled header variants: file name -> flags added to the build's.
_VARIANTS = {
    "o2.h": [],
    "o0.h": ["-O0"],
}

_FALLBACK_WARNING = "colod: the precompiled header was not used (bazel/cc.bzl): a -O or -f flag of this compile differs from the build's"

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
        "// colod's precompiled header %s, as text (bazel/cc.bzl)." % ctx.label,
        "#warning \"%s\"" % _FALLBACK_WARNING,
        "#include \"%s\"" % src.path,
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
    outputs = [header]
    for name, extra_flags in _VARIANTS.items():
        out = ctx.actions.declare_file("%s_pch.h.gch/%s" % (ctx.label.name, name))
        variables = cc_common.create_compile_variables(
            cc_toolchain = cc_toolchain,
            feature_configuration = feature_configuration,
            user_compile_flags = ctx.fragments.cpp.copts + ctx.fragments.cpp.cxxopts + extra_flags,
            use_pic = True,
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
        # With the listed headers: the text includes them.
        CcInfo(compilation_context = cc_common.create_compilation_context(
            headers = depset(outputs + [src] + ctx.files.hdrs),
        )),
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

def _with_pch(kind, srcs, copts, deps, pch):
    """copts and deps of a target that starts from the `kind` precompiled header."""
    if not pch or (type(srcs) == type([]) and not srcs):
        return copts, deps

    # A target's own -O or -f flags would make every variant unusable (gcc
    # would read the header as text and warn); a select() of copts holds
    # only include paths and warnings here (bazel/cuda_rules.bzl).
    if type(copts) == type([]) and [c for c in copts if c.startswith("-O") or c.startswith("-f")]:
        return copts, deps
    return ["-include", "bazel/pch/%s_pch.h" % kind] + copts, deps + ["//bazel/pch:" + kind]

def cc_library(name, srcs = [], copts = [], deps = [], testonly = False, pch = True, **kwargs):
    """Bazel's cc_library, from the library (or, if testonly, the test) precompiled header."""
    copts, deps = _with_pch("test" if testonly else "library", srcs, copts, deps, pch)
    native.cc_library(name = name, srcs = srcs, copts = copts, deps = deps, testonly = testonly, **kwargs)

def cc_binary(name, srcs = [], copts = [], deps = [], testonly = False, pch = True, **kwargs):
    """Bazel's cc_binary, from the library (or, if testonly, the test) precompiled header."""
    copts, deps = _with_pch("test" if testonly else "library", srcs, copts, deps, pch)
    native.cc_binary(name = name, srcs = srcs, copts = copts, deps = deps, testonly = testonly, **kwargs)

def cc_test(name, srcs = [], copts = [], deps = [], pch = True, **kwargs):
    """Bazel's cc_test, from the test precompiled header."""
    copts, deps = _with_pch("test", srcs, copts, deps, pch)
    native.cc_test(name = name, srcs = srcs, copts = copts, deps = deps, **kwargs)
