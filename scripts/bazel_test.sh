#!/usr/bin/env bash
# Builds and tests the C++ core, its C++ unit tests and the pybind11 extension
# with Bazel (bazel test //...), offline, against the project's .venv (see
# scripts/bazel.sh). Extra arguments go to `bazel test`. Exits with Bazel's status.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$SECONDS
bash "$root/scripts/bazel.sh" test //... --test_output=errors "$@"
status=$?
if [ "$status" -eq 0 ]; then
  echo "[bazel_test] PASSED: bazel test //... ($((SECONDS - start))s)"
else
  echo "[bazel_test] FAILED: bazel test //... exited with status $status ($((SECONDS - start))s)"
fi
exit "$status"
