"""The changes torch_xla_ext makes to torch's optimizers: `hook_optimizers`,
installed by the first layer stack, and `around_optimizer_steps`, by the
first stacked list, once per process, never undone (docs/design.md says
why). The other change to torch, kernels of torch's
scan operator for XLA tensors, is `torch_xla_ext.torch_scan`'s whole job and
stays there (docs/design.md)."""
from __future__ import annotations

import functools
from typing import Callable

from torch_xla_ext.patches.patching import Patch, Registered, Replaced

__all__ = ["around_optimizer_steps", "hook_optimizers"]

_OPTIMIZERS = Patch("torch.optim")
_OPTIMIZER_STEPS = Patch("torch.optim")


def hook_optimizers(made: Callable) -> None:
    """Each `torch.optim.Optimizer` made from now on calls `made(optimizer)`
    at the end of its `__init__` (to register per-instance hooks)."""
    def changes():
        import torch

        def wrap(init):
            @functools.wraps(init)
            def __init__(self, *args, **kwargs):
                init(self, *args, **kwargs)
                made(self)
            return __init__
        return [Replaced(torch.optim.Optimizer, "__init__", wrap)]
    _OPTIMIZERS.install(changes)


def around_optimizer_steps(before_step: Callable, after_step: Callable) -> None:
    """Every optimizer's `step()`, those made before too, calls
    `before_step(optimizer)` first and `after_step(optimizer)` after it
    (torch's global step pre- and post-hooks)."""
    def changes():
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook, register_optimizer_step_pre_hook)

        return [Registered(register_optimizer_step_pre_hook,
                           lambda optimizer, args, kwargs: before_step(optimizer)),
                Registered(register_optimizer_step_post_hook,
                           lambda optimizer, args, kwargs: after_step(optimizer))]
    _OPTIMIZER_STEPS.install(changes)
