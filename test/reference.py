"""The reference every scan test compares with: scan's contract as a Python
for loop. `xs` slices are views (`v[i]`), so that writes to a slice reach
`xs` as they do in a user's loop; `None` ys stay None. Subprocess scenarios
import it too (`run_isolated` puts this folder on their path)."""
import torch
from torch.utils._pytree import tree_leaves, tree_map


def scan_loop(fn, init, xs, reverse=False):
    order = range(tree_leaves(xs)[0].shape[0])
    carry, ys = init, [None] * len(order)
    for i in (reversed(order) if reverse else order):
        carry, ys[i] = fn(carry, tree_map(lambda v: v[i], xs))
    return carry, tree_map(lambda *steps: None if steps[0] is None else torch.stack(steps), *ys)


def host_copies(tensors) -> list:
    """Host copies of lazy tensors from one execution: reading them one by one
    would compile and run the graph behind each in turn."""
    import torch_xla
    torch_xla.sync()
    return [t.cpu() for t in tensors]
