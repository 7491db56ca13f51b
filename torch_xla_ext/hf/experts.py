"""transformers' mixture-of-experts layers under a scan.

An experts module that transformers' `use_experts_implementation` made
(Mixtral's, Qwen2-MoE's, Qwen3-MoE's, ...) runs the implementation its config
names (`config._experts_implementation`, which `set_experts_implementation`
changes) at every call. Of transformers' implementations only `batched_mm`
computes with static shapes (it gathers each token's experts' weights); the
others route tokens by data: `eager` loops over the experts that `nonzero`
finds, `grouped_mm` counts tokens per expert with `histc`, which torch_xla
runs on the CPU, and `deepgemm` and `sonicmoe` are CUDA kernels. A scan traces
one layer from shapes alone, so layers with those run one by one, and the
warning says which setting scans.
"""
from __future__ import annotations

from torch import nn

STATIC_SHAPE_IMPLEMENTATION = "batched_mm"


def experts_modules(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The experts modules of `layer`: those made by `use_experts_implementation`,
    which keep their layout flags and the config naming their implementation."""
    return tuple(module for module in layer.modules()
                 if hasattr(module, "is_concatenated")
                 and hasattr(getattr(module, "config", None), "_experts_implementation"))


def experts_reason(experts: tuple[nn.Module, ...]) -> str | None:
    """Why layers with these experts modules cannot run as one scan now, or None."""
    implementations = sorted({module.config._experts_implementation for module in experts}
                             - {STATIC_SHAPE_IMPLEMENTATION})
    if not implementations:
        return None
    names = ", ".join(repr(name) for name in implementations)
    return (f"the layers' experts run experts_implementation={names}, which routes tokens with "
            f"shapes or host-side ops that depend on the data (only "
            f"{STATIC_SHAPE_IMPLEMENTATION!r} has static shapes); call "
            f"model.set_experts_implementation({STATIC_SHAPE_IMPLEMENTATION!r}) (or load the model "
            f"with experts_implementation={STATIC_SHAPE_IMPLEMENTATION!r}) to run them as one scan")
