"""The package's warning classes share one base, `TorchXlaExtWarning`, so a
user can act on all of them at once
(`warnings.simplefilter("error", torch_xla_ext.TorchXlaExtWarning)` in a test
suite that must see every fallback) or on one by its own class. Why a call
runs otherwise is a `Refusal` until the place that warns with it."""
import dataclasses

__all__ = ["NestedScanWarning", "Refusal", "ScanCacheWarning", "TorchXlaExtDeprecationWarning",
           "TorchXlaExtWarning"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why something cannot run as asked (one scan stand for a run of layers,
    torch's scan operator take a step, a cache plan hold a cache), returned
    in place of the result: a value, told apart from a result by its type,
    until the one place that warns with its `reason` or raises it (`error`,
    for a refusal to build what was asked: a stack of layers not alike)."""
    reason: str
    error: type[Exception] = ValueError

    def within(self, where: str) -> "Refusal":
        """The refusal said of a part (`where`: a segment's name)."""
        return dataclasses.replace(self, reason=f"{where}: {self.reason}")

    def exception(self) -> Exception:
        return self.error(self.reason)


class TorchXlaExtWarning(UserWarning):
    """Base of every warning torch_xla_ext gives: something ran otherwise than
    asked (one by one instead of as a scan, a switch honoured in part), and
    the message says what happened instead and why."""


class ScanCacheWarning(TorchXlaExtWarning):
    """`scan` cannot key a function's trace, so it traces it at every call."""


class NestedScanWarning(TorchXlaExtWarning):
    """A switch given to a scan inside another scan's fn has no effect: its
    `partition_fn` or `unroll` where it runs unrolled into the outer step, its
    `step_cotangents` always."""


class TorchXlaExtDeprecationWarning(TorchXlaExtWarning, DeprecationWarning):
    """A deprecated argument or name; the message says what replaces it."""
