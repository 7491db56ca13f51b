"""torch_xla_ext: placeholder tensors, a cached `scan` and zero-copy layer stacks
for PyTorch/XLA.

Importing it changes no environment variable and chooses no device: torch_xla
picks the device as it always does (set `PJRT_DEVICE` to choose)."""
from torch_xla_ext.placeholders import (
    LivePlaceholder, PlaceholderError, depends_on_placeholder, is_placeholder, live_placeholders,
    placeholder, placeholder_id)
# `scan` is the module torch_xla_ext.scan, which is callable as the function
# torch_xla_ext.scan.scan; its stages stay reachable by their names.
from torch_xla_ext import scan
from torch_xla_ext.scan import Lowered, cache_clear, cache_info, lower
from torch_xla_ext import policies
from torch_xla_ext.policies import checkpoint_name
from torch_xla_ext.layer_stack import LayerStack, scan_layers
from torch_xla_ext.hf import stack_layers

__all__ = [
    "LayerStack", "LivePlaceholder", "Lowered", "PlaceholderError", "cache_clear", "cache_info",
    "checkpoint_name", "depends_on_placeholder", "is_placeholder", "live_placeholders", "lower",
    "placeholder", "placeholder_id", "policies", "scan", "scan_layers", "stack_layers",
]
