"""The README is a guide a newcomer acts on: it stays short, its code runs, its
links lead somewhere, and its support table says what the tests check."""
import ast
import importlib
import re
from pathlib import Path

import support
from test_docs import python_blocks

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    """The README's section `## title`, up to the next `## `."""
    return re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M).group(1)


def test_the_readme_fits_in_250_lines():
    assert len(README.splitlines()) <= 250


def test_every_link_leads_to_a_file():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links and [link for link in links if not (ROOT / link).exists()] == []


def test_the_support_table_is_what_the_tests_declare():
    # Import every test module that declares support, as pytest's collection does.
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if "@supports(" in path.read_text():
            importlib.import_module(path.stem)
    header, _, *rows = section("What is supported").split("| family |", 1)[1].split("\n")
    columns = [cell.strip() for cell in header.strip(" |").split("|")]
    assert tuple(columns) == support.COLUMNS
    table = {column: set() for column in columns}
    for row in rows:
        if not row.startswith("|"):
            break
        family, *cells = [cell.strip() for cell in row.strip(" |").split("|")]
        for column, cell in zip(columns, cells):
            if cell == "✓":
                table[column].add(family)
    for column in columns:
        assert table[column] == support.DECLARED[column], (
            f"README's {column!r} column: ticked without a test: "
            f"{sorted(table[column] - support.DECLARED[column])}; tested but not ticked: "
            f"{sorted(support.DECLARED[column] - table[column])}")


def test_the_quickstart_runs(run_isolated, tmp_path):
    # Its own process: it trains, generates and saves a model, as a user would
    # paste it; the checkpoint goes to a temporary directory.
    script = "\n".join(python_blocks(README))
    result = run_isolated(f"import os\nos.chdir({str(tmp_path)!r})\n{script}\n"
                          f"print('quickstart ran', sorted(os.listdir('checkpoint')))\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "quickstart ran" in result.stdout and "model.safetensors" in result.stdout


# ---------------------------------------------------------------- troubleshooting
# The messages a user of stack_layers or LayerStack can meet, collected from
# the code of the packages that emit them: every reason a call runs layer by
# layer (`Unscannable`, `reason=`), every reason a list stays unstacked
# (`Unstackable`) or layers are not stacked (`Refusal`), every warning, every
# error raised (IndexError aside: an index out of range), and what the functions that may return a reason
# (annotated `-> ... | str | None`) return. A message's text is the literal parts of its string
# or f-string (and the module constants named *_REASON); the section must quote
# QUOTE characters in a row of one of them (a shorter part whole).
PACKAGES = ("hf", "layer_stack")
QUOTE = 25


def literal_parts(node: ast.expr | None, constants: dict) -> list[str] | None:
    """The literal text of a message expression; None if it is not built here."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [part.value for part in node.values if isinstance(part, ast.Constant)]
    if isinstance(node, ast.BinOp):
        left, right = literal_parts(node.left, constants), literal_parts(node.right, constants)
        return None if left is None and right is None else (left or []) + (right or [])
    if isinstance(node, ast.Name) and node.id in constants:
        return literal_parts(constants[node.id], constants)
    if isinstance(node, ast.Tuple):  # (iterated, reason)
        parts = [literal_parts(element, constants) for element in node.elts]
        return next((each for each in parts if each), None)
    return None


def message_nodes(tree: ast.Module):
    """(line, message expression) of each place the module emits a message."""
    for function in ast.walk(tree):
        if (isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and function.returns
                and {"str", "None"} <= set(ast.unparse(function.returns).split(" | "))):
            for node in ast.walk(function):
                if isinstance(node, ast.Return):
                    yield node.lineno, node.value
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            if ast.unparse(node.exc.func) != "IndexError":
                yield node.lineno, node.exc.args[0]
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func).rpartition(".")[2]
            if name == "Unstackable" and len(node.args) > 1:
                yield node.lineno, node.args[1]
            elif name in ("Unscannable", "Refusal", "warn") and node.args:
                yield node.lineno, node.args[0]
            for keyword in node.keywords:
                if keyword.arg == "reason":
                    yield node.lineno, keyword.value


def emitted_messages() -> list[tuple[str, list[str]]]:
    """(file:line, literal parts) of every message the packages emit."""
    package_root = ROOT / "torch_xla_ext"
    found = []
    for path in sorted(path for package in PACKAGES for path in (package_root / package).glob("*.py")):
        tree = ast.parse(path.read_text())
        constants = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                     for target in node.targets if isinstance(target, ast.Name)}
        reasons = [(node.lineno, node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(target, ast.Name) and target.id.endswith("_REASON")
                           for target in node.targets)]
        for line, node in [*message_nodes(tree), *reasons]:
            parts = [normalized(part) for part in literal_parts(node, constants) or []]
            parts = [part for part in parts if len(part) >= QUOTE // 2]
            if parts:
                found.append((f"{path.relative_to(ROOT)}:{line}", parts))
    return found


def quotes(section_text: str, parts: list[str]) -> bool:
    """Whether `section_text` holds QUOTE characters in a row of one of the
    parts, or a shorter part whole."""
    return any(part[start:start + QUOTE] in section_text
               for part in parts for start in range(max(1, len(part) - QUOTE + 1)))


def normalized(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_troubleshooting_quotes_every_message_the_packages_emit():
    quoted = normalized(section("Troubleshooting"))
    messages = emitted_messages()
    assert len(messages) > 40  # the collector still finds the messages
    missing = [f"{where}: {' {} '.join(parts)[:120]!r}" for where, parts in messages
               if not quotes(quoted, parts)]
    assert not missing, ("the README's Troubleshooting section quotes nothing of these "
                         "messages:\n" + "\n".join(missing))
