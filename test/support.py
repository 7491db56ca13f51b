"""The README's support table, as the tests declare it.

Each test that shows a model family working with a feature (trained against
the unconverted model, generating its tokens, ...) says so with
`@supports(column, families)`. `test_readme.py` imports every test module and
checks the README's table against what they declared: a cell is ticked exactly
when some test checks it, so the table cannot claim what no test shows nor
miss what one does."""
from collections import defaultdict
from collections.abc import Iterable

COLUMNS = ("training", "LoRA", "default cache", "generate", "tx.generate",
           "gradient checkpointing", "sharded")
DECLARED: dict[str, set[str]] = defaultdict(set)


def supports(column: str, families: str | Iterable[str]):
    """Marks a test as checking `column` for `families` (a family name, or the
    names of a dict of model builders); returns the test unchanged."""
    if column not in COLUMNS:
        raise ValueError(f"supports: unknown column {column!r}; the table's are {COLUMNS}")
    DECLARED[column].update([families] if isinstance(families, str) else families)
    return lambda test: test
