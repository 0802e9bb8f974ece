"""The GPU test lane: the backend and devices of a multi-rank test, and the ``gpu`` marker's skip.

[Note: GPU test lane]
Every test of this repository runs on CPU with gloo; the ``gpu`` lane runs a parity suite (stages
0-3, CPU optimizer offload, bf16/fp16, checkpoint save and load; ``tests/test_gpu_lane.py``) on
CUDA with NCCL wherever CUDA is present, and is skipped with a visible reason (``needs CUDA:
...``) elsewhere. ``tools/gpu_check.sh`` runs it (``pytest -m gpu``) and prints a summary.

* **Backend and devices.** ``run_multirank(..., backend="auto")`` asks :func:`choose_backend`:
  NCCL when CUDA has at least one device per rank, gloo otherwise. With NCCL each forked rank
  calls ``torch.cuda.set_device(rank)`` before joining the group, so rank r computes on GPU r.
* **No CUDA in the parent.** The ranks are forked (see [Note: forked ranks]), and a process that
  has initialised CUDA cannot be forked into processes that use it. So everything here counts
  devices with ``torch.cuda.device_count()``, which asks NVML and leaves CUDA uninitialised,
  never with ``torch.cuda.is_available()`` (which initialises the driver unless
  ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), and the lane's tests touch CUDA only inside the ranks.
* **World size.** :func:`lane_world_size`: 1 on one GPU, 2 where there are more (the CI budget
  of a lane run, not a limit of the code).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import pytest


def cuda_device_count() -> int:
    """CUDA devices visible to this process, counted without initialising CUDA (0 without CUDA)."""
    if not torch.backends.cuda.is_built():
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:  # a driver that cannot be queried counts as no GPU
        return 0


def choose_backend(world_size: int) -> str:
    """``"nccl"`` when CUDA has one device per rank of ``world_size``, else ``"gloo"``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"choose_backend: world_size must be an int >= 1, got {world_size!r}")
    return "nccl" if cuda_device_count() >= world_size else "gloo"


def lane_world_size(max_world_size: int = 2) -> int:
    """The world size of the lane's multi-rank tests: one rank per GPU, at most ``max_world_size``."""
    return max(1, min(max_world_size, cuda_device_count()))


def why_no_cuda(devices: int = 1) -> str | None:
    """Why this machine cannot run a test that needs ``devices`` GPUs (None: it can)."""
    count = cuda_device_count()
    if count >= devices:
        return None
    if not torch.backends.cuda.is_built():
        build = f"torch {torch.__version__} is a CPU-only build"
    else:
        build = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees {count} device(s)"
    return f"needs CUDA: {devices} GPU(s) wanted, {build}"


def needs_cuda(devices: int = 1) -> list[pytest.MarkDecorator]:
    """The ``gpu`` marker plus a skip, with :func:`why_no_cuda` as the reason, where CUDA is absent."""
    import pytest

    reason = why_no_cuda(devices)
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")]


if __name__ == "__main__":  # tools/gpu_check.sh's header line
    print(f"torch {torch.__version__}, CUDA devices: {cuda_device_count()}")
    print(why_no_cuda() or "CUDA present: the lane runs on GPU")
