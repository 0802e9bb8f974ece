"""The ``LRScheduler`` and ``ModelParallelUnit`` protocols: what the engines call on the learning-rate
scheduler and on a Megatron-style ``mpu`` a client hands to ``initialize``.

Both are duck-typed in DeepSpeed (any object with these methods works); the protocols name the
methods the zero family actually calls, so the engines and pipelines can type the seam instead of
passing ``Any``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch.distributed as dist


@runtime_checkable
class LRScheduler(Protocol):
    """A learning-rate scheduler: ``torch.optim.lr_scheduler.LRScheduler`` or ``zero_core.lr_schedules``'.

    ``step()`` runs once per optimizer step; the state methods are used by checkpoints."""

    def step(self) -> object: ...

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object]) -> None: ...


@runtime_checkable
class ModelParallelUnit(Protocol):
    """A model-parallel unit (``mpu``, as Megatron-LM builds it): the process groups of the run."""

    def get_data_parallel_group(self) -> dist.ProcessGroup | None: ...

    def get_model_parallel_group(self) -> dist.ProcessGroup | None: ...

    def get_model_parallel_rank(self) -> int: ...

    def get_model_parallel_world_size(self) -> int: ...
