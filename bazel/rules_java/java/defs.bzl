"""The subset of @rules_java//java:defs.bzl that Bazel 4.2.3 loads.

Bazel registers @bazel_tools//tools/jdk:all as toolchains, so every build
loads that package, which loads these symbols from @rules_java. This project
builds no Java; the forwards to the built-in rules are only there so the
package loads without downloading rules_java.
"""

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
