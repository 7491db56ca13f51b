"""torch_xla_ext: placeholder tensors, a cached `scan` and zero-copy layer stacks
for PyTorch/XLA.

Importing it changes no environment variable and chooses no device: torch_xla
picks the device as it always does (set `PJRT_DEVICE` to choose).

Each name is imported at its first use (PEP 562), so that the parts that need
no torch, such as reading saved metrics reports (`torch_xla_ext.metrics`), do
not import it.
"""
import importlib

# Where each public name is defined.
_DEFINED_IN = {
    "LivePlaceholder": "placeholders", "PlaceholderError": "placeholders",
    "depends_on_placeholder": "placeholders", "is_placeholder": "placeholders",
    "live_placeholders": "placeholders", "placeholder": "placeholders",
    "placeholder_id": "placeholders",
    "TorchXlaExtWarning": "diagnostics",
    "Lowered": "scan", "cache_clear": "scan", "cache_info": "scan", "lower": "scan",
    "checkpoint_name": "policies",
    "LayerStack": "layer_stack", "scan_layers": "layer_stack",
    "stack_layers": "hf", "unstack_layers": "hf",
    "generate": "decoding",
    "openxla_scan": "torch_scan", "register_torch_scan": "torch_scan",
    "unregister_torch_scan": "torch_scan", "trace_loops_in_dynamo": "layer_stack",
}
# Submodules reachable as attributes of the package, as they were when importing
# it imported them all. `scan` is the module torch_xla_ext.scan, which is
# callable as the function torch_xla_ext.scan.scan; its stages stay reachable by
# their names.
_SUBMODULES = ("_C", "hf", "layer_stack", "placeholders", "policies", "scan")

__all__ = [
    "LayerStack", "LivePlaceholder", "Lowered", "PlaceholderError", "TorchXlaExtWarning",
    "cache_clear", "cache_info",
    "checkpoint_name", "depends_on_placeholder", "generate", "is_placeholder", "live_placeholders",
    "lower", "openxla_scan", "placeholder", "placeholder_id", "policies", "register_torch_scan",
    "scan", "scan_layers", "stack_layers", "trace_loops_in_dynamo", "unregister_torch_scan",
    "unstack_layers",
]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _DEFINED_IN:
        value = getattr(importlib.import_module(f"{__name__}.{_DEFINED_IN[name]}"), name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
