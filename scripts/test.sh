#!/usr/bin/env bash
# The whole test suite: set-up (venv, pinned dependencies, C++ build), the
# Bazel build and C++ tests (bazel test //...), then the Python tests, which
# run the C++ test binaries Bazel built. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
bash scripts/bazel_test.sh
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
.venv/bin/python -m pytest -q test --durations=15 "$@"
