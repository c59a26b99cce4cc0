"""Counting device->host transfers: a `TorchFunctionMode` that counts the tensor calls that block on the device.

On a CPU nothing actually waits, but each of these calls is a synchronisation point on an accelerator: the value
must reach the host (`.item()`, `.tolist()`, `bool(t)`), or the output's size depends on the data (boolean-mask
indexing, `nonzero`, `masked_select`, `unique`), or the data moves to the host (`.cpu()`, `.numpy()`). `.to(device)`
is not counted: on a CPU test the accelerator's device is the host, so it cannot be told apart from a transfer.
"""

import torch
from torch.overrides import TorchFunctionMode

_SYNC_METHODS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.masked_select,
    torch.masked_select,
    torch.unique,
    torch.Tensor.unique,
    torch.argwhere,
}


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSyncCounter(TorchFunctionMode):
    """Counts sync calls while `active` is True (callers toggle it to attribute calls to one component)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.active = True
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sync = func in _SYNC_METHODS
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            sync = _has_bool_index(args[1])
        if sync and self.active:
            self.count += 1
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)
