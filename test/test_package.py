"""The package as a user imports it: no device chosen for them, and each
module reachable by its name."""
import os


def test_import_sets_no_environment_variable(run_isolated):
    environment = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    # torch_xla sets its own variables (XLA_FLAGS, ...) when imported; ours
    # must add nothing, PJRT_DEVICE above all.
    process = run_isolated("""
        import os
        import torch_xla
        before = dict(os.environ)
        import torch_xla_ext
        changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
        print(sorted(changed))
    """, clean_env=environment)
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == "[]"


def test_scan_module_is_reachable_and_callable(run_isolated):
    process = run_isolated("""
        import importlib
        import torch, torch_xla
        import torch_xla_ext
        import torch_xla_ext.scan as scan_module
        assert scan_module is importlib.import_module("torch_xla_ext.scan")
        assert scan_module.cache is importlib.import_module("torch_xla_ext.scan.cache")
        from torch_xla_ext.scan import scan
        device = torch_xla.device()
        xs = torch.arange(6.0, device=device).reshape(3, 2)
        step = lambda c, x: (c + x, c)
        called_as_module = torch_xla_ext.scan(step, torch.zeros(2, device=device), xs)
        called_as_function = scan(step, torch.zeros(2, device=device), xs)
        for a, b in zip(called_as_module, called_as_function):
            assert torch.equal(a.cpu(), b.cpu())
        print(called_as_module[0].cpu().tolist())
    """)
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == "[6.0, 9.0]"
