"""Counting host synchronisations: ``count_host_syncs()``, measurable on CPU.

On a GPU, reading a tensor's value on the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, ``.cpu()``, ``.numpy()``) waits for every queued kernel. A CPU run cannot feel
those stalls, but it can count the calls: a ``TorchDispatchMode`` sees
``aten._local_scalar_dense`` (what ``.item()``/``float()``/``bool()``/``int()`` of a tensor run)
and copies from a non-CPU device to the CPU, and a ``TorchFunctionMode`` sees ``Tensor.cpu``,
``Tensor.tolist`` and ``Tensor.numpy``, which on a CPU tensor return without reaching the
dispatcher but are device-to-host copies on a GPU. Reads inside ``torch.optim`` are not counted:
its optimizers keep their ``step`` counters on the host on purpose (no device sync on a GPU). See [Note: scalars stay on the device in the step].
"""

from __future__ import annotations

import collections
import contextlib
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READ_METHODS = {
    torch.Tensor.cpu: "Tensor.cpu",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.numpy: "Tensor.numpy",
}
_TORCH_OPTIM = f"{os.sep}torch{os.sep}optim{os.sep}"
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class HostSyncCount:
    """The syncs seen so far: ``total``, ``by_kind`` (op name -> count) and, per sync, the
    innermost frames of ``zero_*`` code that caused it (``where``), to name the culprit."""

    def __init__(self) -> None:
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.where: list[str] = []
        self.ignored_in_torch_optim = 0

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def add(self, kind: str) -> None:
        stack = traceback.extract_stack()
        if any(_TORCH_OPTIM in f.filename for f in stack):
            # torch's optimizers keep their ``step`` counters on the host on purpose (unless
            # capturable/fused): reading them is no device sync on a GPU.
            self.ignored_in_torch_optim += 1
            return
        self.by_kind[kind] += 1
        frames = [f for f in stack if "/zero_" in f.filename and not f.filename.endswith("host_syncs.py")]
        self.where.append(f"{kind} at " + (f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"))

    def reset(self) -> None:
        self.by_kind.clear()
        self.where.clear()

    def __repr__(self) -> str:
        return f"HostSyncCount(total={self.total}, by_kind={dict(self.by_kind)}, where={self.where})"


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, count: HostSyncCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count.add("aten._local_scalar_dense")
        elif func in _COPIES:
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0] if func is torch.ops.aten.copy_.default else out
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu":
                self.count.add("device-to-host copy")
        return out


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, count: HostSyncCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> object:
        name = _HOST_READ_METHODS.get(func)
        if name is not None:
            self.count.add(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncCount]:
    """Count the host syncs of the code run inside: ``with count_host_syncs() as c: ...; c.total``."""
    count = HostSyncCount()
    with _FunctionCounter(count), _DispatchCounter(count):
        yield count
