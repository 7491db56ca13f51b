#!/usr/bin/env bash
# The whole test suite: set-up (venv, pinned dependencies, C++ build), the
# Python tests (they include the C++ unit tests), then the Bazel build and
# C++ tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
.venv/bin/python -m pytest -q test "$@"
bash scripts/bazel_test.sh
