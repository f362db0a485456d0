#!/bin/sh
echo "bazel coverage is not supported in colod's offline build" >&2
exit 1
