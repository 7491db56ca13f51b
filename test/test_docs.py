"""The docs' examples run, and their lists of public names are complete."""
import ast
import re
from pathlib import Path

import torch_xla_ext

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, re.S | re.M)


def test_every_public_name_has_an_api_entry():
    headings = "\n".join(re.findall(r"^###? .*$", (DOCS / "api.md").read_text(), re.M))
    missing = [name for name in torch_xla_ext.__all__ if f"`{name}" not in headings
               and f" {name}" not in headings]
    assert not missing, f"docs/api.md has no heading naming {missing}"


def test_the_api_examples_run_in_order(run_isolated):
    # One script, in a process of its own: the examples build on each other, and
    # a placeholder misused by a future edit must not take the test run down.
    script = "\n".join(python_blocks((DOCS / "api.md").read_text()))
    result = run_isolated(script + "\nprint('examples ran')\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "examples ran" in result.stdout


def imported_packages(path: Path) -> set[str]:
    """The torch_xla_ext packages and modules that the module at `path` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "torch_xla_ext":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("torch_xla_ext."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names
                         if alias.name.startswith("torch_xla_ext."))
    return found


def test_each_package_imports_only_what_the_design_allows():
    rows = re.findall(r"^\| `(\w+)` \| .* \| (.*) \|$", (DOCS / "design.md").read_text(), re.M)
    allowed = {package: set(re.findall(r"`(\w+)`", imports)) for package, imports in rows}
    package_root = Path(torch_xla_ext.__file__).parent
    assert set(allowed) == {path.stem for path in package_root.iterdir()
                            if path.suffix == ".py" and path.stem != "__init__"
                            or (path / "__init__.py").exists()}
    for package, may_import in allowed.items():
        files = ([package_root / f"{package}.py"] if (package_root / f"{package}.py").exists()
                 else sorted((package_root / package).glob("*.py")))
        for path in files:
            imports = imported_packages(path) - {package}
            assert imports <= may_import, (
                f"{path.relative_to(package_root.parent)} imports {sorted(imports - may_import)}, "
                f"which docs/design.md does not allow {package} to import")
