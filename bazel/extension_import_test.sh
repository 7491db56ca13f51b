#!/bin/bash
# Usage: extension_import_test.sh PYTHON EXTENSION_SO
# Imports the Bazel-built extension into the environment's Python, after torch
# as the package does, and checks a few of its functions.
set -euo pipefail
python="$1"
extension="$2"
exec "$python" - "$extension" <<'PY'
import importlib.util
import sys

import torch

path = sys.argv[1]
spec = importlib.util.spec_from_file_location("_C", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)

p = module.create_placeholder([2, 3], torch.float32)
assert p.sizes == [2, 3] and p.dtype == torch.float32, (p.sizes, p.dtype)
assert not p.has_value()
assert module.find_placeholder(p.id) is p or module.find_placeholder(p.id).id == p.id
try:
    p.assign()
except module.PlaceholderError as e:
    assert p.describe() in str(e), str(e)
else:
    raise AssertionError("assign() did not raise PlaceholderError")
try:
    module.create_placeholder([-1], torch.float32)
except ValueError:
    pass
else:
    raise AssertionError("a negative size did not raise ValueError")
table = module.ParameterTable()
assert [table.use_placeholder(p.id), table.use_device_data(p.id), table.use_placeholder(p.id)] == [0, 1, 0]
assert table.parameters == [("placeholder", p.id), ("device_data", p.id)]
print("extension_import_test: %s loaded and works (%s)" % (path, p.describe()))
PY
