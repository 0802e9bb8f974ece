"""Debug mode: every tensor handed to a ``zero_core.comm`` op must be on the backend's device.

[Note: collective tensors live on the backend's device]
NCCL reduces and moves GPU tensors only (a CPU tensor is an error there), and gloo reads CPU
tensors. A flag, norm, digest or counter created with a bare ``torch.tensor(...)`` lands on the
CPU and works under gloo, so CPU tests cannot see the bug. Every tensor the library builds for
a collective is therefore created with the accelerator's device
(``get_accelerator().current_device_name()``) or the device of the data it describes, and this
mode makes the rule checkable on CPU: switched on (``ZERO_COMM_DEVICE_CHECK=1`` or
:func:`set_device_check`), each op checks its tensors against the device the backend wants
(gloo: ``cpu``; nccl: the current CUDA device; another backend: the accelerator's current
device), or against an explicit ``expected`` device, which lets a test demand a device the
machine does not have and see the check fire. Off by default: the check costs a Python call
per tensor and reads no tensor data (no host sync).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

ENV_VAR = "ZERO_COMM_DEVICE_CHECK"


@dataclasses.dataclass
class DeviceCheckSettings:
    """This process's device-check switch: ``enabled`` None follows the environment variable;
    ``expected`` None derives the device from the default group's backend."""

    enabled: bool | None = None
    expected: torch.device | None = None


# the process's settings (set_device_check writes them; the check reads them)
SETTINGS = DeviceCheckSettings()


class CommDeviceError(RuntimeError):
    """A tensor handed to a collective is not on the backend's device."""


def set_device_check(enabled: bool, expected: str | torch.device | None = None) -> None:
    """Switch the check on or off for this process; ``expected`` overrides the backend's device
    (``None``: derive it from the default group's backend)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_device_check: enabled must be a bool, got {enabled!r}")
    if expected is not None and not isinstance(expected, (str, torch.device)):
        raise TypeError(f"set_device_check: expected must be None, a str or a torch.device, got {expected!r}")
    SETTINGS.enabled = enabled
    SETTINGS.expected = None if expected is None else torch.device(expected)


def device_check_enabled() -> bool:
    if SETTINGS.enabled is not None:
        return SETTINGS.enabled
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def backend_device() -> torch.device:
    """The device the default group's backend communicates from."""
    if SETTINGS.expected is not None:
        return SETTINGS.expected
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    from zero_core.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _same(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    return expected.index is None or actual.index == expected.index


def check_device(tensor: Any, name: str, where: str) -> None:
    """Raise :class:`CommDeviceError` when the mode is on and ``tensor`` is on the wrong device."""
    if not device_check_enabled() or not isinstance(tensor, torch.Tensor):
        return
    expected = backend_device()
    if not _same(tensor.device, expected):
        raise CommDeviceError(
            f"zero_core.comm.{where}: {name} is on {tensor.device}, but the backend communicates from "
            f"{expected} (shape {tuple(tensor.shape)}, dtype {tensor.dtype}); create collective tensors on "
            "the accelerator's device (See [Note: collective tensors live on the backend's device])"
        )
