"""torch_xla_ext: placeholder tensors, a cached `scan` and zero-copy layer stacks
for PyTorch/XLA."""
import os

# PJRT's CPU backend unless the user chose a device (PJRT_DEVICE=TPU on a TPU host).
os.environ.setdefault("PJRT_DEVICE", "CPU")

from torch_xla_ext.placeholders import (  # noqa: E402
    PlaceholderError, depends_on_placeholder, is_placeholder, placeholder, placeholder_id)
from torch_xla_ext.scan import cache_clear, cache_info, scan  # noqa: E402
from torch_xla_ext.layer_stack import LayerStack, scan_layers  # noqa: E402

__all__ = [
    "LayerStack", "PlaceholderError", "cache_clear", "cache_info", "depends_on_placeholder",
    "is_placeholder", "placeholder", "placeholder_id", "scan", "scan_layers",
]
