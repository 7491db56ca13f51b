"""Every warning the package gives is a TorchXlaExtWarning, of a class of its own."""
import ast
import importlib
import pkgutil
from pathlib import Path

import torch_xla_ext
from torch_xla_ext.diagnostics import TorchXlaExtWarning

PACKAGE_ROOT = Path(torch_xla_ext.__file__).parent


def all_modules():
    for info in pkgutil.walk_packages([str(PACKAGE_ROOT)], prefix="torch_xla_ext."):
        yield importlib.import_module(info.name)


def test_every_warning_class_of_the_package_has_the_one_base():
    classes = {value for module in all_modules() for value in vars(module).values()
               if isinstance(value, type) and issubclass(value, Warning)
               and value.__module__.startswith("torch_xla_ext")}
    assert len(classes) >= 10  # the walk found the package's warnings
    strays = sorted(each.__qualname__ for each in classes
                    if not issubclass(each, TorchXlaExtWarning))
    assert not strays, f"warning classes without the base: {strays}"


def test_every_warn_call_names_a_category_of_the_package():
    builtin = {name for name in dir(__builtins__ if isinstance(__builtins__, dict) else
                                    __builtins__) if name.endswith("Warning")}
    builtin |= {"Warning", "UserWarning", "RuntimeWarning", "DeprecationWarning"}
    found, wrong = 0, []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "warn" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "warnings"):
                found += 1
                category = (node.args[1] if len(node.args) > 1 else
                            next((k.value for k in node.keywords if k.arg == "category"), None))
                name = ast.unparse(category) if category is not None else "UserWarning"
                if name.rpartition(".")[2] in builtin:
                    wrong.append(f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno} ({name})")
    assert found >= 10
    assert not wrong, f"warnings.warn with a category not of the package: {wrong}"

