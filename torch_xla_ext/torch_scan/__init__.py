"""torch's own scan operator on XLA tensors, run as `torch_xla_ext.scan`.

torch has a scan operator, `torch._higher_order_ops.scan.scan(combine_fn,
init, xs, dim=0, reverse=False)` (the higher-order op
`torch.ops.higher_order.scan`), which `torch.export` keeps as one node and
`torch.compile` backends such as TorchTPU lower to a loop. On torch_xla it runs
unrolled: every step is traced into the graph. With this package, code written
against that operator runs on torch_xla as one While loop forward and one
backward, with `scan`'s activation policies:

    register_torch_scan()                          # from now on, in this process
    carry, ys = torch._higher_order_ops.scan.scan(combine_fn, init, xs)

    with register_torch_scan("save_nothing"):      # only in this block, this policy
        ...

Its contract is torch's (the operator's call, its results), and its results
are those of the for loop::

    def scan(combine_fn, init, xs, dim=0, reverse=False):
        carry, ys = init, []
        for x in (reversed(xs.unbind(dim)) if reverse else xs.unbind(dim)):
            carry, y = combine_fn(carry, x)
            ys.append(y)
        return carry, stack(ys if not reverse else ys[::-1])

Nothing happens at import: a registration is the caller's decision, since it
changes what an operator of torch does for every caller in the process.

The stages, one module each: `translation` (the operator's call as `scan`'s,
and the options a call gets), `dispatch` (the kernels added to torch's
operator, installed once; which calls they run as `scan` and which they hand
to torch), `registration` (the switch and its context manager), `backend`
(`openxla_scan`, the `torch.compile` backend that keeps the operator's bodies
as loops through torch_xla's dynamo bridge), `operator_call` (`scan`'s
contract as one call of the operator, for code that `torch.export` traces:
`layer_stack`'s runs of layers).
"""
from torch_xla_ext.torch_scan.backend import openxla_scan
from torch_xla_ext.torch_scan.dispatch import TorchScanWarning
from torch_xla_ext.torch_scan.registration import (
    TorchScanRegistration, register_torch_scan, unregister_torch_scan)

__all__ = ["TorchScanRegistration", "TorchScanWarning", "openxla_scan", "register_torch_scan",
           "unregister_torch_scan"]
