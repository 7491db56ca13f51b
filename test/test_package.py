"""The package as a user imports it: no device chosen for them, and each
module reachable by its name."""
import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path


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


def test_a_wheel_installs_and_imports_in_a_clean_environment(tmp_path):
    """`pip install --no-build-isolation .` as the README says, checked as a wheel
    built from the checkout and installed into a new virtual environment that
    sees only torch, torch_xla and numpy (this interpreter's site-packages, not
    the checkout or its editable install). About 25 s: the build reuses
    setup.sh's compiled objects in build/."""
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                    "--quiet", "--wheel-dir", str(tmp_path / "dist"), str(root)],
                   check=True, cwd=root)
    wheel, = (tmp_path / "dist").glob("torch_xla_ext-*.whl")
    venv.create(tmp_path / "venv", with_pip=False)
    site_packages, = (tmp_path / "venv" / "lib").glob("python3*/site-packages")
    # The dependencies, by path: a .pth line adds a directory without running
    # the .pth files in it, so the checkout's editable install stays unseen.
    (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                    "--target", str(site_packages), str(wheel)], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    result = subprocess.run([str(python), "-c", textwrap.dedent("""
        import torch, torch_xla, torch_xla_ext as tx
        p = tx.placeholder((2, 3))
        carry, ys = tx.scan(lambda c, x: (c + x, c), torch.zeros(3, device=torch_xla.device()),
                            torch.ones(4, 3, device=torch_xla.device()))
        print(tx.__file__, tx.placeholder_id(p) > 0, carry.cpu().tolist())
    """)], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    location, has_id, carry = result.stdout.split(" ", 2)
    assert location.startswith(str(site_packages)) and has_id == "True"
    assert carry.strip() == "[4.0, 4.0, 4.0]"
