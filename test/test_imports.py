"""What importing the package pulls in: nothing of torch until a name that needs
it is used, so that saved metrics reports can be read without torch; every
public name as before, each from the module that defines it; and no module
that imports itself through others."""
import ast
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


PACKAGE = REPO / "torch_xla_ext"


def module_files() -> dict[str, Path]:
    """Each torch_xla_ext module's dotted name -> its source file."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(source: str, modules: dict) -> set[str]:
    """The torch_xla_ext modules `source` imports, anywhere in it
    (an import inside a function runs when it is called, and a circle
    through it fails then as at import time): `from package import name`
    imports the submodule `name` if there is one, else the package."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch_xla_ext"):
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                         else node.module for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names
                         if alias.name.startswith("torch_xla_ext"))
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules that importing it executes first: those it
    imports, and their packages (their `__init__` runs first) other than its
    own (which are being imported already). The root package imports its
    parts lazily (`__getattr__`), so it is no node."""
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in imported_modules(path.read_text(), modules):
            parts = imported.split(".")
            for depth in range(2, len(parts) + 1):
                ancestor = ".".join(parts[:depth])
                own = name == ancestor or name.startswith(ancestor + ".")
                if ancestor in modules and (ancestor == imported or not own):
                    edges.add(ancestor)
        graph[name] = edges - {name, "torch_xla_ext"}
    graph.pop("torch_xla_ext")
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in `graph` (its modules in order), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state:
                cycle = visit(imported)
                if cycle:
                    return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    # The graph is the real one: edges within a package and across packages.
    assert "torch_xla_ext.placeholders.registry" in graph["torch_xla_ext.placeholders.tensors"]
    assert "torch_xla_ext.patches.torch_xla" in graph["torch_xla_ext.placeholders.syncs"]
    assert "torch_xla_ext.scan" in graph["torch_xla_ext.layer_stack.stack"]
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    modules = {"torch_xla_ext.x": Path("x.py"), "torch_xla_ext.x.y": Path("y.py")}
    lazy = "def f():\n    from torch_xla_ext.x import y, z\n    import torch_xla_ext.w\n"
    assert imported_modules(lazy, modules) == {"torch_xla_ext.x.y", "torch_xla_ext.x",
                                               "torch_xla_ext.w"}
