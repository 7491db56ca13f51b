#!/usr/bin/env bash
# The whole test suite: set-up (venv, pinned dependencies, C++ build), the
# Bazel build and C++ tests (bazel test //...), then the Python tests, which
# run the C++ test binaries Bazel built. Extra arguments go to pytest.
# pytest runs in TEST_WORKERS processes (pytest-xdist; default 2, the cores CI
# has): a test spends most of its time in one XLA compilation thread.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
bash scripts/bazel_test.sh
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
.venv/bin/python -m pytest -q test --durations=15 \
  --numprocesses="${TEST_WORKERS:-2}" --dist=worksteal "$@"
