"""What importing the package pulls in: nothing of torch until a name that needs
it is used, so that saved metrics reports can be read without torch; and every
public name as before, each from the module that defines it."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH_MODULES = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla'))"


def fresh_python(source: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`source` in a new interpreter (the scenario server has torch imported
    already), importing this checkout's torch_xla_ext."""
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_package_and_its_metrics_reader_import_no_torch():
    completed = fresh_python(f"""if True:
        import sys
        import torch_xla_ext
        from torch_xla_ext.metrics import (
            FIGURE_ROWS, figures, format_table, hlo_parameter_count, parse_report,
            peak_rss_bytes)
        import torch_xla_ext.metrics
        # The live figures are listed, and imported (with torch_xla) at their first use.
        assert {{"collect", "live_report"}} <= set(dir(torch_xla_ext.metrics))
        assert set(torch_xla_ext.__all__) <= set(dir(torch_xla_ext))
        print({TORCH_MODULES})
    """)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == "[]\n"


def test_the_scripts_harness_imports_no_torch():
    completed = fresh_python(f"import sys, harness; print({TORCH_MODULES})",
                             cwd=REPO / "scripts")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == "[]\n"


def test_every_public_name_is_the_defining_modules(run_isolated):
    completed = run_isolated("""
        import importlib, os, types
        before = dict(os.environ)
        import torch_xla_ext
        from torch_xla_ext import (
            LayerStack, LivePlaceholder, Lowered, PlaceholderError, cache_clear, cache_info,
            checkpoint_name, depends_on_placeholder, is_placeholder, live_placeholders, lower,
            openxla_scan, placeholder, placeholder_id, policies, register_torch_scan, scan,
            scan_layers, stack_layers, unregister_torch_scan)
        defined_in = {
            "torch_xla_ext.placeholders": ["LivePlaceholder", "PlaceholderError",
                "depends_on_placeholder", "is_placeholder", "live_placeholders", "placeholder",
                "placeholder_id"],
            "torch_xla_ext.scan": ["Lowered", "cache_clear", "cache_info", "lower"],
            "torch_xla_ext.policies": ["checkpoint_name"],
            "torch_xla_ext.layer_stack": ["LayerStack", "scan_layers"],
            "torch_xla_ext.hf": ["stack_layers"],
            "torch_xla_ext.torch_scan": ["openxla_scan", "register_torch_scan",
                                         "unregister_torch_scan"],
        }
        for module, names in defined_in.items():
            for name in names:
                assert getattr(torch_xla_ext, name) is getattr(importlib.import_module(module), name), name
                assert globals()[name] is getattr(torch_xla_ext, name), name
        assert scan is importlib.import_module("torch_xla_ext.scan") and callable(scan)
        assert policies is importlib.import_module("torch_xla_ext.policies")
        assert isinstance(torch_xla_ext._C, types.ModuleType)
        assert set(torch_xla_ext.__all__) <= set(dir(torch_xla_ext))
        star = {}
        exec("from torch_xla_ext import *", star)
        assert set(star) - {"__builtins__"} == set(torch_xla_ext.__all__)
        try:
            torch_xla_ext.no_such_name
        except AttributeError as error:
            assert "no_such_name" in str(error)
        else:
            raise AssertionError("an unknown name was found")
        changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
        # torch_xla was imported before the scenario (isolated.py), so whatever
        # it sets is set already: any change here is the package's own.
        print(sorted(changed))
    """)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]"
