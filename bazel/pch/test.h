// What every test's compile starts from (bazel/cc.bzl): the libraries' set
// and GoogleTest. Libraries do not get GoogleTest: a larger precompiled
// header costs every file that loads it.
#include "library.h"

#include "gtest/gtest.h"
