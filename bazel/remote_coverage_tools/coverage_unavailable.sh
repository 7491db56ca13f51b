#!/bin/sh
# Stand-in for Bazel's downloaded coverage tools (see BUILD next to this file).
echo "bazel coverage is not supported in this offline set-up" >&2
exit 1
