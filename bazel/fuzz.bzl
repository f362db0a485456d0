"""colod_fuzz_test: a libFuzzer target that is also a test.

Under --config=fuzz (clang, libFuzzer, ASan + UBSan) the test fuzzes the
target for `seconds` from its seed corpus; in every other build it replays
the corpus through the same entry point, so the seeds (and every crash found
and added to them) stay regression tests everywhere.
"""

load("//bazel:cc.bzl", "cc_binary")

def colod_fuzz_test(name, srcs, deps, corpus, seconds = 30, **kwargs):
    """A fuzz target NAME (LLVMFuzzerTestOneInput in `srcs`) and its test.

    Args:
      name: the test; the binary is NAME_bin.
      srcs: sources defining LLVMFuzzerTestOneInput.
      deps: what they call.
      corpus: the seed inputs (files).
      seconds: how long the test fuzzes under --config=fuzz.
      **kwargs: passed to the test (size, tags, ...).
    """
    cc_binary(
        name = name + "_bin",
        testonly = True,
        srcs = srcs,
        deps = deps + select({
            "//bazel/fuzz:fuzzing": [],
            "//conditions:default": ["//bazel/fuzz:replay_main"],
        }),
        linkopts = select({
            "//bazel/fuzz:fuzzing": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
    )
    native.sh_test(
        name = name,
        srcs = ["//bazel/fuzz:fuzz_test.sh"],
        args = ["$(location :%s_bin)" % name, str(seconds)] + ["$(location %s)" % c for c in corpus],
        data = [":" + name + "_bin"] + corpus,
        **kwargs
    )
