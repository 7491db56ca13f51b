#!/usr/bin/env bash
# Builds and tests the C++ core, its C++ unit tests and the pybind11 extension
# with Bazel (bazel test //...), offline, against the project's .venv.
# Installs Debian's bazel-bootstrap (Bazel 4.2.3) with apt when bazel is
# missing. Extra arguments go to `bazel test`. Exits with Bazel's status.
#
# Bazel's output base lives in .bazel/ in the checkout (gitignored); the Bazel
# server it starts exits after 15 idle minutes (or: bazel --output_user_root=
# "$PWD/.bazel" shutdown). The interpreter is .venv/bin/python, or
# $TORCH_XLA_EXT_PYTHON if set (see bazel/python_env.bzl).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
start=$SECONDS

if ! command -v bazel >/dev/null 2>&1; then
  echo "[bazel_test] bazel not found: installing Debian's bazel-bootstrap (Bazel 4.2.3) with apt"
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then sudo=(sudo); fi
  log="$(mktemp)"
  if ! { "${sudo[@]}" apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq bazel-bootstrap; } \
       >"$log" 2>&1; then
    tail -n 30 "$log"
    rm -f "$log"
    echo "[bazel_test] FAILED: could not install bazel-bootstrap"
    exit 1
  fi
  rm -f "$log"
  echo "[bazel_test] installed $(command -v bazel) in $((SECONDS - start))s"
fi

if [ -z "${TORCH_XLA_EXT_PYTHON:-}" ] && [ ! -x .venv/bin/python ]; then
  echo "[bazel_test] FAILED: no .venv/bin/python; run scripts/setup.sh first (or set TORCH_XLA_EXT_PYTHON)"
  exit 1
fi

bazel --output_user_root="$root/.bazel" --max_idle_secs=900 \
  test //... --test_output=errors "$@"
status=$?
if [ "$status" -eq 0 ]; then
  echo "[bazel_test] PASSED: bazel test //... ($((SECONDS - start))s)"
else
  echo "[bazel_test] FAILED: bazel test //... exited with status $status ($((SECONDS - start))s)"
fi
exit "$status"
