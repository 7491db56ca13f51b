"""The switch: `register_torch_scan` and `unregister_torch_scan`, and how a
call through torch's operator gets `scan`'s options.

torch's operator has no place for `scan`'s own arguments (`partition_fn`,
`unroll`), so they are the registration's: every call on XLA tensors while it
is in effect gets them. A registration used as a context manager restores, on
exit, the state before it (unregistered, or the earlier options), so a block
can run its calls with another policy. The state is the process's, as the
dispatcher's kernels are: a registration on one thread is in effect on all.
"""
from __future__ import annotations

from typing import Callable

from torch_xla_ext import policies
from torch_xla_ext.torch_scan import dispatch
from torch_xla_ext.torch_scan.translation import LoopOptions


class TorchScanRegistration:
    """`register_torch_scan`'s result: its `options`, and, as a context
    manager, the state before it restored on exit."""

    def __init__(self, options: LoopOptions, previous: LoopOptions | None):
        self.options = options
        self._previous = previous

    def __enter__(self) -> "TorchScanRegistration":
        return self

    def __exit__(self, *exc_info) -> None:
        dispatch.set_active(self._previous)

    def __repr__(self) -> str:
        return (f"TorchScanRegistration(partition_fn={self.options.partition_fn!r}, "
                f"unroll={self.options.unroll!r})")


def register_torch_scan(partition_fn: Callable | str = policies.save_everything, *,
                        unroll: int | bool = 1) -> TorchScanRegistration:
    """From now on, torch's scan operator (`torch._higher_order_ops.scan.scan`,
    `torch.ops.higher_order.scan`) runs a call on XLA tensors as
    `torch_xla_ext.scan` with these options: one While loop forward, one
    backward. Returns a handle that, used as a context manager, restores the
    state before the call on exit."""
    options = LoopOptions.checked(partition_fn, unroll, "register_torch_scan")
    previous = dispatch.active()
    dispatch.set_active(options)
    return TorchScanRegistration(options, previous)


def unregister_torch_scan() -> None:
    """From now on, torch's scan operator runs as torch's own kernels again."""
    dispatch.set_active(None)
