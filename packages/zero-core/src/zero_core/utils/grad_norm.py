"""Gradient statistics on the device: the sum of squares and the non-finite flag.

[Note: scalars stay on the device in the step]
On a GPU every ``.item()``, ``float(t)``, ``bool(t)`` or ``.cpu()`` of a device tensor waits
for all queued kernels: one per parameter turns the step into hundreds of stalls. So the
optimizer step computes its statistics as fused multi-tensor reductions
(``torch._foreach_norm``: a few kernels however many tensors) into 0-dim tensors created on
the gradients' device, reduces each with ONE collective, clips by multiplying in a device
coefficient (as ``torch.nn.utils.clip_grad_norm_`` does), and reads the host at most once per
optimizer step: the fp16 overflow decision or the bf16 skip of a non-finite norm. Losses
accumulate as device tensors too; they reach the host only when printed, written to a monitor
or asked for (``engine.last_loss``, ``get_global_grad_norm()``). Tests count the syncs with a
``TorchDispatchMode`` (``zero_core.testing.host_syncs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _device_of(tensors: Sequence[torch.Tensor], device: torch.device | str | None) -> torch.device:
    if tensors:
        return tensors[0].device
    if device is not None:
        return torch.device(device)
    from zero_core.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _by_device(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by device, first device first (partial offload mixes host and GPU)."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def _combine(partials: list[torch.Tensor], reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One 0-dim result on the first group's device: one copy per extra device, not per tensor."""
    if len(partials) == 1:
        return partials[0]
    return reduce(torch.stack([p.to(partials[0].device) for p in partials]))


def sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Σ‖t‖² over ``tensors`` in fp32, as a 0-dim tensor on their device (no host sync).

    ``device`` places the zero of an empty list (a rank owning no gradient still joins the
    all-reduce, with a tensor on the backend's device); it defaults to the accelerator's.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=_device_of(tensors, device))
    return _combine(
        [
            torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32))).square()
            for ts in _by_device(tensors)
        ],
        torch.sum,
    )


def any_nonfinite(tensors: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """A 0-dim bool tensor on the device: does any of ``tensors`` hold an inf or a NaN?

    The max-abs norm cannot overflow for finite values and propagates inf and NaN, so one fused
    reduction answers for all tensors without a host read.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=_device_of(tensors, device))
    amax = _combine(
        [
            torch.stack(torch._foreach_norm(ts, float("inf"), dtype=torch.float32)).max()
            for ts in _by_device(tensors)
        ],
        torch.max,
    )
    return ~torch.isfinite(amax)


def needs_scaling(grad_scale: float | torch.Tensor) -> bool:
    """Whether gradients must be multiplied by ``grad_scale``, decided without a host read: a
    device tensor (a clip coefficient) is always multiplied in (times 1.0 is exact)."""
    return isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0


def clip_coefficient(norm: torch.Tensor, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """``min(1, max_norm / (norm + eps))`` as a device tensor, as ``clip_grad_norm_`` computes it
    without a host sync."""
    return torch.clamp(max_norm / (norm + eps), max=1.0)
