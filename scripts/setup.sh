#!/usr/bin/env bash
# Creates or reuses .venv in the checkout, installs the pinned dependencies and
# builds the C++ extension. Sourced by the other scripts; safe to run again.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
echo "[setup] installing pinned dependencies (the first time downloads torch, several GB)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt \
  2> >(grep -v "^WARNING: Location" >&2)
echo "[setup] building the C++ extension"
# No build isolation: the build must use the torch installed above, not download another.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e . \
  2> >(grep -v "^WARNING: Location" >&2)
