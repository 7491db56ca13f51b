"""The package's warning classes share one base, `TorchXlaExtWarning`, so a
user can act on all of them at once
(`warnings.simplefilter("error", torch_xla_ext.TorchXlaExtWarning)` in a test
suite that must see every fallback) or on one by its own class."""

__all__ = ["ScanCacheWarning", "TorchXlaExtDeprecationWarning", "TorchXlaExtWarning"]


class TorchXlaExtWarning(UserWarning):
    """Base of every warning torch_xla_ext gives: something ran otherwise than
    asked (one by one instead of as a scan, a switch honoured in part), and
    the message says what happened instead and why."""


class ScanCacheWarning(TorchXlaExtWarning):
    """`scan` cannot key a function's trace, so it traces it at every call."""


class TorchXlaExtDeprecationWarning(TorchXlaExtWarning, DeprecationWarning):
    """A deprecated argument or name; the message says what replaces it."""
