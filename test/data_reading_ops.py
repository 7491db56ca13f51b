"""Every ATen op that reads its inputs' data on XLA, called on placeholders:
the sweep that test_placeholder_data_reads.py runs in a process of its own
(torch_xla 2.9.0 kills the process when such an op reads a placeholder).

`tagged_ops()` are the ops torch tags as data-dependent (output shape or value);
`arguments(op, tensor)` builds a call of one from its schema, each tensor
argument being `tensor` (integer indices and masks are where an op tells them
apart)."""
import re

import torch
import torch_xla
import torch_xla.debug.metrics as met
from torch.utils._python_dispatch import TorchDispatchMode

import torch_xla_ext as tx
from torch_xla_ext.placeholders import HOST_READING_XLA_KERNELS

DATA_DEPENDENT_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def swept_ops() -> list:
    """The ATen overloads with a data-dependent tag that run on XLA: through a
    kernel of torch_xla's or torch_xla's CPU fallback (none is left out), and
    those whose XLA kernel reads data untagged."""
    ops = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if ((any(tag in op.tags for tag in DATA_DEPENDENT_TAGS)
                 or op.name() in HOST_READING_XLA_KERNELS)
                    and torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), "XLA")):
                ops.append(op)
    return ops


def arguments(op, tensor: torch.Tensor) -> tuple[list, dict]:
    """Positional and keyword arguments for `op`: `tensor` for each tensor (and
    a boolean mask of it for a list of optional tensors: indexing's masks),
    the default or a small value for the rest."""
    args, kwargs = [], {}
    for argument in op._schema.arguments:
        if argument.has_default_value():
            continue
        kind = argument.type
        element = kind.getElementType() if isinstance(kind, torch._C.ListType) else None
        if isinstance(kind, torch._C.TensorType):
            value = tensor
        elif element is not None and "Tensor" in str(element):
            value = [tensor > 0]
        elif isinstance(kind, (torch._C.IntType, torch._C.SymIntType, torch._C.FloatType,
                               torch._C.NumberType)):
            value = 1
        elif isinstance(kind, torch._C.BoolType):
            value = False
        elif element is not None:
            value = [1]
        else:
            raise TypeError(f"no sample value for {op}'s argument {argument.name}: {kind}")
        if argument.kwarg_only:
            kwargs[argument.name] = value
        else:
            args.append(value)
    return args, kwargs


def call_on_placeholder(op) -> str:
    """The PlaceholderError `op` raises on a placeholder (AssertionError if none)."""
    p = tx.placeholder((1,), torch.int64)
    args, kwargs = arguments(op, p)
    try:
        op(*args, **kwargs)
    except tx.PlaceholderError as error:
        return str(error)
    raise AssertionError(f"{op} ran on a placeholder")


def call_in_scan(op) -> tuple[str, int]:
    """The error `op` raises when scan's fn calls it on its x, and the line of
    fn that calls it."""
    def step(carry, x):
        return carry, op(*arguments(op, x)[0], **arguments(op, x)[1])

    device = torch_xla.device()
    try:
        tx.scan(step, torch.zeros((), device=device), torch.ones(3, 1, dtype=torch.int64, device=device))
    except tx.PlaceholderError as error:
        return str(error), step.__code__.co_firstlineno + 1
    raise AssertionError(f"{op} ran in a scan")


SHAPE = "its output's shape depends on the data"
MASK = "it indexes by a boolean mask, whose positions torch_xla finds with nonzero"
CPU = "torch_xla has no XLA kernel for it and runs it on the CPU"
HOST = "torch_xla's kernel for it reads the data on the host"

# The cases of issue 26 and a few more, each with the op its message names and why.
ISSUE_CASES = {
    "nonzero": (lambda p: (p > 0).nonzero(), "aten.nonzero", SHAPE),
    "mask": (lambda p: p[p > 0], "aten.index.Tensor (called by __getitem__)", MASK),
    "unique": (lambda p: torch.unique(p), "aten._unique2 (called by unique)", SHAPE),
    "masked_select": (lambda p: torch.masked_select(p, p > 0), "aten.masked_select", SHAPE),
    "where": (lambda p: torch.where(p > 0), "aten.nonzero (called by where)", SHAPE),
    "eig": (lambda p: torch.linalg.eig(p.reshape(2, 2)), "aten.linalg_eig", CPU),
    "masked_write": (lambda p: p.clone().__setitem__(p > 0, 0),
                     "aten.index_put (called by __setitem__)", MASK),
    "multinomial": (lambda p: torch.multinomial(p.abs(), 2), "aten.multinomial", HOST),
}


def check_issue_case(name: str) -> None:
    """Runs one of `ISSUE_CASES` on a float32[4] placeholder and checks its
    message: the op, the line that called it, the placeholder, the reason."""
    call, op, reason = ISSUE_CASES[name]
    try:
        call(tx.placeholder((4,)))
    except tx.PlaceholderError as error:
        message = str(error)
    else:
        raise AssertionError(f"{name} ran on a placeholder")
    assert message.startswith(f"cannot run {op} at {__file__}:{call.__code__.co_firstlineno} "), message
    assert re.search(r"on a \w+\[[\d,]+\] tensor computed from float32\[4\] placeholder #\d+",
                     message), message
    assert reason in message, message
    print("checked", name, flush=True)


def host_reading_kernels() -> dict[str, list[str]]:
    """The ops with an XLA kernel of torch_xla's that copy data to the host
    when run on small real tensors (a device-to-host transfer shows in
    torch_xla's metrics), each with the ops that reached the device, which
    are what the guard sees (`qr` runs `linalg_qr`). Ops whose sample call
    fails are skipped."""
    device = torch_xla.device()
    found = {}
    for op in _xla_kernel_ops():
        sample = (torch.rand(2, 2) + 0.5).to(device)
        _discard_pending_work()
        try:
            args, kwargs = arguments(op, sample)
        except TypeError:
            continue  # an argument type the sampler does not make
        met.clear_all()
        try:
            with _Reached() as reached:
                op(*args, **kwargs)
        except (RuntimeError, IndexError, ValueError, TypeError):
            continue  # arguments this op refuses
        if "TransferFromDeviceTime" in met.metric_names():
            found[op.name()] = reached.ops
    return found


class _Reached(TorchDispatchMode):
    """Records the names of the ops that reach the device."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


def op_named(name: str):
    """The ATen overload of a name such as 'aten::index.Tensor' or 'aten::qr'."""
    base, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _xla_kernel_ops() -> list:
    ops = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name)
        if name.startswith("__") or not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            # Out and in-place variants compute as the functional op; _to_cpu is a copy to the host.
            if (not overload.endswith("out") and overload != "Q" and not name.endswith("_")
                    and op.name() != "aten::_to_cpu"
                    and torch._C._dispatch_has_kernel(op.name())  # not TorchScript's alone
                    and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "XLA")):
                ops.append(op)
    return ops


def _discard_pending_work() -> None:
    """Syncs before the next sample: a sampled call may have built a graph
    that XLA refuses to compile, which this sweep, watching transfers, ignores."""
    try:
        torch_xla.sync()
    except (ValueError, RuntimeError):
        pass


def check_scan_error() -> None:
    """A scanned fn that indexes with a mask: the error names fn, the op and
    fn's line, and scan works afterwards."""
    device = torch_xla.device()

    def route(carry, x):
        return carry + x[x > 0].sum(), x

    try:
        tx.scan(route, torch.zeros((), device=device), torch.randn(3, 4, device=device))
    except tx.PlaceholderError as error:
        message = str(error)
    else:
        raise AssertionError("a masked index ran in a scan")
    line = route.__code__.co_firstlineno + 1
    assert message.startswith(
        "scan's fn 'check_scan_error.<locals>.route' calls aten.index.Tensor (called by "
        f"__getitem__) at {__file__}:{line} (`return carry + x[x > 0].sum(), x`)"), message
    assert "torch.where(mask, x, 0)" in message, message
    carry, _ = tx.scan(lambda c, x: (c + x.sum(), x * 2), torch.zeros((), device=device),
                       torch.ones(3, 4, device=device))
    assert carry.item() == 12.0
    print("checked scan", flush=True)


def sweep() -> None:
    """Calls every tagged op on a placeholder and in a scan, printing
    'ok NAME' after each: a crash shows which op killed the process."""
    for op in swept_ops():
        name = op.name().replace("::", ".")
        # An op with a composite kernel names the op it runs and itself (argwhere: nonzero).
        named = op._schema.name.partition("::")[2]
        message = call_on_placeholder(op)
        assert message.startswith("cannot run aten.") and named in message, message
        assert "placeholder #" in message, message
        message, line = call_in_scan(op)
        assert message.startswith("scan's fn 'call_in_scan.<locals>.step' calls aten."), message
        assert named in message, message
        assert f"{__file__}:{line}" in message, message
        print("ok", name, flush=True)
