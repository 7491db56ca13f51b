"""The README's support table, as the tests declare it, and the check its
"generate" column's tests share.

Each test that shows a model family working with a feature (trained against
the unconverted model, generating its tokens, ...) says so with
`@supports(column, families)`. `test_readme.py` imports every test module and
checks the README's table against what they declared: a cell is ticked exactly
when some test checks it, so the table cannot claim what no test shows nor
miss what one does."""
import warnings
from collections import defaultdict
from collections.abc import Iterable

import torch

from torch_xla_ext.layer_stack import LayerByLayerWarning

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


def greedy_tokens_of_both(reference, model, prompt, max_new_tokens: int) -> tuple:
    """generate()'s greedy tokens of the unconverted `reference` and of the
    converted `model` (each moved to the prompt's device, in eval mode), and
    the messages of the LayerByLayerWarnings `model`'s generate() raised."""
    tokens = []
    for which in (reference, model):
        which.to(prompt.device).eval()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens.append(which.generate(prompt, max_new_tokens=max_new_tokens,
                                         do_sample=False).cpu().tolist())
    return tokens, [str(each.message) for each in caught
                    if each.category is LayerByLayerWarning]
