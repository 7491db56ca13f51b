#!/usr/bin/env bash
# Runs Bazel for this checkout: `bash scripts/bazel.sh <bazel command> ...`.
# Installs Debian's bazel-bootstrap (Bazel 4.2.3) with apt when bazel is missing.
#
# Bazel's output base lives in .bazel/ in the checkout (gitignored); the Bazel
# server it starts exits after 15 idle minutes (or: bash scripts/bazel.sh
# shutdown). The interpreter is .venv/bin/python, or $TORCH_XLA_EXT_PYTHON if
# set (see bazel/python_env.bzl).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if ! command -v bazel >/dev/null 2>&1; then
  echo "[bazel] bazel not found: installing Debian's bazel-bootstrap (Bazel 4.2.3) with apt" >&2
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then sudo=(sudo); fi
  log="$(mktemp)"
  if ! { "${sudo[@]}" apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq bazel-bootstrap; } \
       >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    rm -f "$log"
    echo "[bazel] FAILED: could not install bazel-bootstrap" >&2
    exit 1
  fi
  rm -f "$log"
fi

if [ -z "${TORCH_XLA_EXT_PYTHON:-}" ] && [ ! -x .venv/bin/python ]; then
  echo "[bazel] FAILED: no .venv/bin/python; run scripts/setup.sh first (or set TORCH_XLA_EXT_PYTHON)" >&2
  exit 1
fi

exec bazel --output_user_root="$root/.bazel" --max_idle_secs=900 "$@"
