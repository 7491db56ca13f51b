#!/usr/bin/env bash
# The project's main job: set up, then compare torch_xla metrics of a for loop
# and scan side by side (scripts/compare_metrics.py; arguments pass through).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
# The device is PJRT_DEVICE's, CPU if unset (compare_metrics.py chooses it).
.venv/bin/python scripts/compare_metrics.py "$@"
