"""The subset of @rules_cc//cc:defs.bzl that Bazel 4.2.3 and this project use.

Bazel 4's C++ rules are built in; this file only forwards to them, which is all
the rules_cc release pinned by Bazel 4 did for these symbols. Bazel's own
@bazel_tools//tools/cpp and tools/jdk packages load cc_library, cc_binary,
cc_toolchain and cc_toolchain_suite from here.
"""

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_import(**kwargs):
    native.cc_import(**kwargs)

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)
