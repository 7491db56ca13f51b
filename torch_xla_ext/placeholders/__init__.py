"""Placeholder tensors: XLA tensors with a shape and a dtype but no device buffer.

They exist to stage out HLO: trace a function on placeholders, lower the result,
and no byte moves to the device. Each one is registered with the C++ core, which
gives it a process-unique id (torch_xla's own placeholders are keyed on object
addresses, which are reused once freed), describes it in every error message
and lists the ones alive (`live_placeholders()`).

A placeholder has no value, so anything that would read one must fail cleanly
rather than crash the process, as torch_xla 2.9.0 does when it executes a graph
that reads a placeholder. Three mechanisms see to that:

* Placeholders are `PlaceholderTensor`s, and every tensor computed from one (or
  written in place from one, or a gradient accumulated through one) becomes one
  too. Reading the value of a `PlaceholderTensor` that really depends on
  placeholder data raises `PlaceholderError` naming it, and so does any ATen
  op that would read its data on the way (`DataReadGuard`: ops whose output
  shape depends on the data, such as `nonzero`, and ops torch_xla runs on the
  CPU); in torch_xla 2.9.0 they kill the process.
* Every sync entry point of torch_xla (`torch_xla.sync()`, `xm.mark_step()`,
  ...) first discards the pending computations that read placeholders: their
  tensors become value-less placeholders themselves, so the sync runs the rest
  and later reads raise `PlaceholderError`.
* While `scan` traces a function, syncing raises `PlaceholderError`.

The sync guard is the one process-wide change (made through
`torch_xla_ext.patches.torch_xla`): importing this package installs nothing;
the first placeholder (or `tracing` region) installs it, once.

The modules, one stage each, importing only the ones above them:
`registry` (what a placeholder is: the C++ core's data, ids, descriptions,
the live lists, the argument checks), `syncs` (the sync guard and `tracing`
regions), `reads` (the guards on reads of values and on ops that read data),
`tensors` (`placeholder()`, `PlaceholderTensor` and the marking of what is
computed from placeholders). Every name other packages use is imported from
here.
"""
from torch_xla_ext.placeholders.reads import (
    HOST_READING_XLA_KERNELS, data_read_reason, indices_position)
from torch_xla_ext.placeholders.registry import (
    SUPPORTED_DTYPES, LivePlaceholder, PlaceholderError, depends_on_placeholder, is_placeholder,
    live_placeholders, placeholder_id)
from torch_xla_ext.placeholders.syncs import (
    DiscardedComputationWarning, is_tracing, tracing, tracing_what)
from torch_xla_ext.placeholders.tensors import (
    PlaceholderTensor, mark_derived, mutates_arguments, placeholder, placeholder_sources,
    unguarded_placeholder)

__all__ = [
    "HOST_READING_XLA_KERNELS", "SUPPORTED_DTYPES", "DiscardedComputationWarning", "LivePlaceholder",
    "PlaceholderError", "PlaceholderTensor", "data_read_reason", "depends_on_placeholder",
    "indices_position", "is_placeholder", "is_tracing", "live_placeholders", "mark_derived",
    "mutates_arguments", "placeholder", "placeholder_id", "placeholder_sources", "tracing",
    "tracing_what", "unguarded_placeholder",
]
