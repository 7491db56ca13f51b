"""Activation memory policies: what scan's forward loop keeps for its backward loop.

A policy is passed as `partition_fn` to `scan`, `scan_layers`, `LayerStack` and
`stack_layers` (or by name: `partition_fn="save_nothing"`). Like
`jax.checkpoint_policies`, it decides for each value the backward step needs
whether the forward loop stacks it (one slice per step, kept until the
backward loop reads it) or the backward step recomputes it from what is kept:

- `save_everything`: every activation the backward needs (the default; the
  most memory), but a value that elementwise ops and views make from kept
  values and the step's inputs alone (silu(gate) * up from gate and up),
  which the backward step recomputes as XLA's fusion would in the unrolled
  loop, and rows gathered from the step's inputs by kept indices (each
  token's experts' weights, gathered from the layer's), which the backward
  step gathers again;
- `save_nothing`: only the step's inputs; the backward step recomputes the
  whole forward step (the least memory, one more forward);
- `save_dots`: matmul and convolution outputs; the cheap ops after them are
  recomputed;
- `save_only(*names)`: the tensors named with `checkpoint_name`;
- `offload(*names)`: the named tensors, moved to host memory by the forward
  loop and back to the device by the backward loop just before use; the rest
  is recomputed. On a backend without a separate host memory (PJRT CPU) they
  stay on the device, with a warning.

Whatever the policy, the step's inputs are always available (the carry is
stacked, `xs` and captured weights are read where they are), and random ops
(dropout masks) are never recomputed, since a second draw would differ. What
fn runs under `torch_xla.utils.checkpoint.checkpoint` is recomputed whatever
the policy, as that checkpoint asks.
"""
from __future__ import annotations

import collections
import dataclasses
import operator
import warnings

import torch
from torch._functorch import partitioners

from torch_xla_ext.diagnostics import TorchXlaExtWarning

__all__ = ["checkpoint_name", "Policy", "save_everything", "save_nothing", "save_dots",
           "save_only", "offload", "resolve", "OffloadWarning"]


# ---------------------------------------------------------------------------
# Naming activations

@torch.library.custom_op("torch_xla_ext::checkpoint_name", mutates_args=())
def _named(tensor: torch.Tensor, name: str) -> torch.Tensor:
    # An op of its own, so that the name reaches AOTAutograd's graphs; XLA
    # lowers the clone to nothing.
    return tensor.clone()


@_named.register_fake
def _(tensor, name):
    return torch.empty_like(tensor)


_named.register_autograd(lambda ctx, grad: (grad, None))
NAMED_OP = torch.ops.torch_xla_ext.checkpoint_name.default


def checkpoint_name(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Names `tensor` for `save_only` and `offload`; returns it unchanged.

    An identity: outside scan's tracing of `fn` it returns `tensor` itself at no
    cost, so layer code can name its activations and still run as usual."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"checkpoint_name: expected a tensor, got {type(tensor).__name__} "
                        f"{tensor!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"checkpoint_name: name must be a non-empty str, got {name!r}")
    from torch_xla_ext.placeholders import is_tracing
    return _named(tensor, name) if is_tracing() else tensor


# Names that mark the inputs and outputs of a region torch_xla's checkpoint
# wraps inside fn (see scan/regions.py): "<prefix><number> in" / "... out".
REGION_PREFIX = "torch_xla_ext:checkpoint region "


def names_in(graph: torch.fx.Graph) -> list[str]:
    """The names `checkpoint_name` gave in `graph`, in order."""
    return list(dict.fromkeys(node.args[1] for node in graph.nodes if node.target is NAMED_OP
                              and not node.args[1].startswith(REGION_PREFIX)))


# ---------------------------------------------------------------------------
# Policies

class Policy:
    """An AOTAutograd partitioner choosing the values the forward loop keeps.
    Policies compare by value, so a policy made afresh at each call shares the
    trace of an equal one."""

    __slots__ = ()

    #: names whose values go to host memory (`offload`)
    offloaded: tuple[str, ...] = ()

    def saves(self, node: torch.fx.Node) -> bool:
        """Whether a value the backward step needs is kept rather than recomputed."""
        raise NotImplementedError

    def __call__(self, joint_module, joint_inputs, *, num_fwd_outputs, **options):
        return _partition(joint_module, num_fwd_outputs, self)

    def check_names(self, graph: torch.fx.Graph) -> None:
        """Raises if the policy asks for a name no `checkpoint_name` in `graph` gives."""


@dataclasses.dataclass(frozen=True, slots=True)
class _SaveEverything(Policy):
    #: values elementwise ops and views make from kept values and the step's
    #: inputs, and rows gathered from those inputs by kept indices, are
    #: recomputed, not kept
    recomputes_cheap = True

    def saves(self, node):
        return True

    def __repr__(self):
        return "save_everything"


@dataclasses.dataclass(frozen=True, slots=True)
class _SaveNothing(Policy):
    def saves(self, node):
        return False

    def __repr__(self):
        return "save_nothing"


_DOT_OPS = frozenset([torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
                      torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default,
                      torch.ops.aten.convolution.default, torch.ops.aten.mv.default,
                      torch.ops.aten.dot.default])


@dataclasses.dataclass(frozen=True, slots=True)
class _SaveDots(Policy):
    def saves(self, node):
        return node.target in _DOT_OPS

    def __repr__(self):
        return "save_dots"


def _check_names(policy: str, names: tuple) -> tuple[str, ...]:
    if not names:
        raise ValueError(f"{policy}() needs at least one name given by checkpoint_name")
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{policy}: names must be non-empty strs, got {name!r}")
    return tuple(dict.fromkeys(names))


@dataclasses.dataclass(frozen=True, slots=True)
class _SaveNamed(Policy):
    names: tuple[str, ...]
    offloaded: tuple[str, ...] = ()

    def saves(self, node):
        return node.target is NAMED_OP and node.args[1] in self.names

    def check_names(self, graph):
        given = names_in(graph)
        missing = [name for name in self.names if name not in given]
        if missing:
            raise ValueError(
                f"{self!r}: no checkpoint_name in the traced fn is named "
                f"{', '.join(map(repr, missing))}; the names it gives are "
                f"{given if given else 'none (call torch_xla_ext.checkpoint_name(tensor, name))'}")

    def __repr__(self):
        kind = "offload" if self.offloaded else "save_only"
        return f"{kind}({', '.join(map(repr, self.names))})"


save_everything = _SaveEverything()
save_nothing = _SaveNothing()
save_dots = _SaveDots()


def save_only(*names: str) -> Policy:
    """Keeps only the tensors named `names` with `checkpoint_name`."""
    return _SaveNamed(_check_names("save_only", names))


def offload(*names: str) -> Policy:
    """Keeps the tensors named `names` in host memory; recomputes the rest."""
    names = _check_names("offload", names)
    return _SaveNamed(names, offloaded=names)


_BY_NAME = {"save_everything": save_everything, "save_nothing": save_nothing,
            "save_dots": save_dots}


def resolve(partition_fn, who: str = "scan"):
    """`partition_fn` as a callable: a policy name is looked up."""
    if isinstance(partition_fn, str):
        try:
            return _BY_NAME[partition_fn]
        except KeyError:
            raise ValueError(
                f"{who}: unknown policy {partition_fn!r}; the policies are "
                f"{', '.join(_BY_NAME)}, save_only(*names) and offload(*names) in "
                f"torch_xla_ext.policies, or any AOTAutograd partitioner") from None
    if not callable(partition_fn):
        raise TypeError(f"{who}: partition_fn must be a policy of torch_xla_ext.policies, a "
                        f"policy's name or an AOTAutograd partitioner, got "
                        f"{type(partition_fn).__name__} {partition_fn!r}")
    return partition_fn


class OffloadWarning(TorchXlaExtWarning):
    """An offload policy kept its tensors on the device (no host memory)."""


_warned_kinds: set = set()


def warn_no_host_memory(policy: Policy, device_kind: str) -> None:
    if device_kind not in _warned_kinds:
        _warned_kinds.add(device_kind)
        warnings.warn(f"{policy!r}: {device_kind} devices have no host memory apart from their "
                      f"own, so the named tensors stay where they are (kept, as save_only "
                      f"would); on TPU or GPU they go to host memory",
                      OffloadWarning, stacklevel=2)


# ---------------------------------------------------------------------------
# The partitioner

def _partition(joint_module: torch.fx.GraphModule, num_fwd_outputs: int, policy: Policy):
    graph = joint_module.graph
    policy.check_names(graph)
    primals = [n for n in graph.nodes if partitioners._is_primal(n)]
    fwd_outputs, bwd_outputs, fwd_descs, _ = partitioners._extract_fwd_bwd_outputs(
        joint_module, num_fwd_outputs=num_fwd_outputs)
    forward_graph = partitioners._extract_graph_with_inputs_outputs(
        graph, primals, fwd_outputs, fwd_descs, "forward")
    forward_names = {n.name for n in forward_graph.nodes if n.op != "output"}
    forward = {n for n in graph.nodes if n.name in forward_names}
    forward |= _loop_results(graph, forward)
    _read_names_in_backward(graph, forward)

    needed = _backward_needs(bwd_outputs, forward)
    checkpointed = _checkpointed(forward)
    saved, seen = [], set()
    while needed:
        node = needed.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_tensor(node) and (node.op == "placeholder" or _is_random(node) or (
                node not in checkpointed and policy.saves(node))):
            saved.append(node)
        else:  # recomputed by the backward step from what it reads
            needed.extend(n for n in node.all_input_nodes if n in forward)
    saved = _in_graph_order(_each_value_once(saved))
    if getattr(policy, "recomputes_cheap", False):
        saved = _without_cheaply_recomputed(saved)
    return partitioners._extract_fwd_bwd_modules(joint_module, saved, [],
                                                 num_fwd_outputs=num_fwd_outputs)


def _loop_results(graph: torch.fx.Graph, forward: set) -> set:
    """The results of a nested scan's forward loop (`torch_xla_ext::scan_loop`)
    that only the backward reads (the activations its own backward loop
    needs): forward values, which the policy keeps or not as any other; else
    the backward step would run the inner forward loop again to get them."""
    loop = torch.ops.torch_xla_ext.scan_loop.default
    return {n for n in graph.nodes if n.target is operator.getitem
            and n.args[0] in forward and n.args[0].target is loop}


def _in_graph_order(nodes: list) -> list:
    """Each of `nodes` once, in the order of their graph."""
    order = {node: i for i, node in enumerate(nodes[0].graph.nodes)} if nodes else {}
    return sorted(dict.fromkeys(nodes), key=order.__getitem__)


def _read_names_in_backward(graph: torch.fx.Graph, forward: set) -> None:
    """Makes backward ops read a named tensor through its name, so that a
    policy saving the name serves them too (the name is an identity)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for named in [n for n in forward if n.target is NAMED_OP]:
        source = named.args[0]
        for user in list(source.users):
            if user not in forward and order[user] > order[named]:
                user.replace_input_with(source, named)


def _backward_needs(bwd_outputs, forward: set) -> list:
    """The forward values the backward ops read."""
    backward = _reachable({o for o in bwd_outputs if isinstance(o, torch.fx.Node)},
                          lambda n: () if n in forward else n.all_input_nodes)
    return [n for n in backward if n in forward]


def _checkpointed(forward: set) -> set:
    """The forward nodes strictly inside a checkpoint region: computed from one
    of its inputs on the way to one of its outputs. Never saved."""
    ends = {}
    for node in forward:
        if node.target is NAMED_OP and node.args[1].startswith(REGION_PREFIX):
            region, _, end = node.args[1].rpartition(" ")
            ends.setdefault((region, end), set()).add(node)
    inside = set()
    for (region, end), outputs in ends.items():
        if end == "out":
            inputs = ends.get((region, "in"), set())
            after_inputs = _reachable(inputs, lambda n: [u for u in n.users if u in forward])
            before_outputs = _reachable(outputs, lambda n: n.all_input_nodes)
            inside |= (after_inputs & before_outputs) - inputs - outputs
    return inside


def _reachable(starts: set, step) -> set:
    seen, stack = set(), list(starts)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


# Ops whose result is their input's values in the same order, only shaped anew.
_VIEW_OPS = frozenset(["view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze",
                       "alias", "detach"])


def _view_root(node: torch.fx.Node) -> torch.fx.Node:
    """The value `node` is a view of, through a chain of views; itself if none."""
    while (node.op == "call_function" and getattr(node.target, "_opname", None) in _VIEW_OPS
           and len(node.all_input_nodes) == 1):
        node = node.all_input_nodes[0]
    return node


def _each_value_once(saved: list) -> list:
    """Each saved value once: views of one value (the three reshapes of a
    normed input that the q, k and v projections read, softmax's output and
    its reshape) are redone by the backward step from that value, which is
    saved once instead of a copy per view."""
    roots = {node: _view_root(node) for node in saved}
    views_of = collections.Counter(roots.values())
    kept = [root if root is not node and _is_tensor(root)
            and (root in roots or views_of[root] > 1) else node
            for node, root in roots.items()]
    return list(dict.fromkeys(kept))


# How many cheap ops (elementwise ops, gathers of step inputs; views are free)
# the backward step may redo to get a value from kept ones.
_CHEAP_OP_DEPTH = 3


def _is_elementwise(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and not _is_random(node) and (
        node.target is NAMED_OP or isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.pointwise in node.target.tags)


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "_opname", None) in _VIEW_OPS


# Ops that read rows of a tensor by index.
_GATHER_OPS = frozenset([torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default,
                         torch.ops.aten.gather.default, torch.ops.aten.embedding.default])


def _is_gather_of_input(node: torch.fx.Node) -> bool:
    """Rows gathered from a step input (a layer weight, through views):
    gathering them again reads as many bytes as reading them back from a
    stack (batched_mm experts gather each token's experts' weights, the
    step's largest values)."""
    return node.target in _GATHER_OPS and _view_root(node.all_input_nodes[0]).op == "placeholder"


def _without_cheaply_recomputed(saved: list) -> list:
    """`saved` (in graph order) without the values that a few elementwise ops,
    views and gathers of the step's inputs make from the other kept values
    and the step's inputs alone, and with those inputs: the backward step
    recomputes them in its fusions, where keeping them would stack another
    activation (SwiGLU's silu(gate) and silu(gate) * up beside gate and up,
    flattened for the down projection; a norm's output beside its input and
    scale; each token's experts' weights beside the routing indices)."""
    kept = set(saved)
    recomputed: set = set()
    inputs_read: set = set()

    def cheap(node) -> bool:
        return _is_elementwise(node) or _is_gather_of_input(node)

    def from_kept(node, depth, reads: set) -> bool:
        if node in kept and node not in recomputed:
            return True
        if node.op == "placeholder":  # a step input: always there
            reads.add(node)
            return True
        # Views and names move no data: they cost no depth.
        free = _is_view(node) or node.target is NAMED_OP
        return ((free or depth > 0 and cheap(node))
                and all(from_kept(n, depth - (not free), reads) for n in node.all_input_nodes))

    for node in saved:
        reads: set = set()
        if (cheap(node) or _is_view(node)) and all(
                from_kept(n, _CHEAP_OP_DEPTH - 1, reads) for n in node.all_input_nodes):
            recomputed.add(node)
            inputs_read |= reads
    return _in_graph_order([*(node for node in saved if node not in recomputed), *inputs_read])


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _is_random(node: torch.fx.Node) -> bool:
    if node.target is operator.getitem:
        node = node.args[0]
    return isinstance(node.target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in node.target.tags)
