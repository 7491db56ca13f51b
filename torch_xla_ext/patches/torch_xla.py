"""torch_xla: XLA kernels for ops torch_xla 2.9 runs on the host.

torch_xla has no XLA kernel for some ops that layers call, and runs them on
the CPU through its fallback: every call moves their inputs to the host and
back, and a scan cannot trace them on placeholders (tensors with no data to
move). `lower_host_ops()` gives those ops XLA kernels made of ops torch_xla
lowers, once per process:

* `linalg_solve_triangular` (gated linear attention's chunked delta rule:
  Qwen3.5, Qwen3-Next) as `triangular_solve`, which torch_xla lowers to
  XLA's TriangularSolve; solving from the right (`left=False`) is the
  transposed solve from the left.

Autograd is torch's own (the kernels sit below it): its derivative of the
op calls the op again, here on the device.
"""
from __future__ import annotations

import threading

import torch

__all__ = ["lower_host_ops"]

_LOCK = threading.Lock()
_LIBRARY: list = []  # the torch.library.Library holding the kernels, once made


def lower_host_ops() -> None:
    """Registers the XLA kernels above, once per process."""
    if _LIBRARY:
        return
    with _LOCK:
        if _LIBRARY:
            return
        library = torch.library.Library("aten", "IMPL")
        library.impl("linalg_solve_triangular", _solve_triangular, "XLA")
        _LIBRARY.append(library)
        # Whether an op reads its inputs' data on the host is cached per op.
        from torch_xla_ext.placeholders import data_read_reason
        data_read_reason.cache_clear()


def _solve_triangular(matrix: torch.Tensor, rhs: torch.Tensor, *, upper: bool, left: bool = True,
                      unitriangular: bool = False) -> torch.Tensor:
    if not left:  # X A = B is A^T X^T = B^T
        return _solve_triangular(matrix.mT, rhs.mT, upper=not upper, left=True,
                                 unitriangular=unitriangular).mT
    solution, _ = torch.triangular_solve(rhs, matrix, upper=upper, transpose=False,
                                         unitriangular=unitriangular)
    return solution
