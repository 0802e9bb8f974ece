"""``engine.offload_states()`` / ``engine.reload_states()``: model states off the device and back.

[Note: offloading model states between phases]
DeepSpeed's engine can move its model states off the accelerator and back, for jobs that
alternate between phases that need the memory for something else (RLHF: the actor's
optimizer states make room for generation, then come back for training). The API and its
kinds of state are DeepSpeed's (``OffloadStateTypeEnum``):

* ``lp_params``: this rank's partitions of the training-dtype parameters (the shards);
* ``hp_params``: the fp32 master partitions (when they are separate tensors);
* ``optim_states``: the optimizer's state tensors (``exp_avg`` ...);
* ``lp_grads``: this rank's reduced gradient partitions (present between backward and step);
* ``contiguous_grad_buffer``: the gradient reduction buffer. Our stage-3 reduction buckets
  live only while a reduction runs, so there is never one to move; the name is accepted.

As in DeepSpeed this is ZeRO stage 3 only, with ``device="cpu"``, and not combined with
``offload_optimizer`` / ``offload_param`` (their states already live off the device under
their own management). ``include=None`` means every kind.

How tensors move: each tensor's storage is copied to the target and the *same tensor objects*
are re-pointed at the copy (``Tensor.set_``), so every reference (the optimizer's state dicts
keyed by master parameters, ``p.zero_shard``, the strategy's tables) stays valid and nothing
has to be rebuilt. Tensors that share a storage move together once: in fp32 the master
partition *is* the parameter shard, so moving either kind moves both (aliasing is preserved,
memory is not duplicated). Parameters kept gathered between steps (persistent ones, the
prefetch cache) are released first and re-gathered by ``reload_states``.

While states are off the device, ``engine.backward`` / ``engine.step`` raise a clear error
instead of failing on a device mismatch (or, on a CPU accelerator, silently training on the
offloaded copies); forward is allowed only when the parameters stayed (``lp_params`` not
offloaded), which covers generation with the optimizer states away. ``reload_states``
restores every kind that was offloaded, to the device each tensor came from; with
``non_blocking=True`` the copies are asynchronous and the caller synchronizes the
accelerator before using the states, as with DeepSpeed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from zero_core.protocols.optimizer_offload import NoOptimizerOffload

if TYPE_CHECKING:
    from zero_core.engine.strategy import TrainingStrategy
    from zero_core.zero.stage3.strategy import Stage3Strategy

STATE_KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


class OffloadStateTypeEnum(str, enum.Enum):
    """DeepSpeed's names of the kinds of model state ``offload_states(include=...)`` takes."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDeviceEnum(str, enum.Enum):
    """DeepSpeed's offload targets; ``offload_states`` accepts ``cpu`` (as DeepSpeed does)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


def _kind_name(kind: object) -> str:
    """``OffloadStateTypeEnum.optim_states`` (or its value, or the plain string) -> ``"optim_states"``."""
    value = getattr(kind, "value", kind)
    if not isinstance(value, str) or value not in STATE_KINDS:
        raise ValueError(f"offload_states: unknown state kind {kind!r}; allowed: {', '.join(STATE_KINDS)}")
    return value


def _move_storages(
    tensors: Iterable[torch.Tensor | None],
    partners: Iterable[torch.Tensor | None],
    device: torch.device,
    pin: bool,
    non_blocking: bool,
) -> None:
    """Copy each distinct storage of ``tensors`` to ``device`` and re-point at the copy every tensor of
    ``tensors`` *and* of ``partners`` that uses it.

    So tensors sharing a storage (the fp32 master that is the shard) keep sharing it whichever of
    them was asked for. Assigning ``.data`` keeps each tensor object (and so every reference to
    it) and works on parameters.
    """
    wanted = {
        t.untyped_storage().data_ptr() for t in tensors if t is not None and t.untyped_storage().nbytes()
    }
    by_storage: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in [*tensors, *partners]:
        if t is None or id(t) in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(id(t))
        key = t.untyped_storage().data_ptr()
        if key in wanted:
            by_storage.setdefault(key, []).append(t)
    with torch.no_grad():
        for group in by_storage.values():
            old = group[0].untyped_storage()
            if old.device == device and not pin:
                continue
            new = torch.empty(old.nbytes(), dtype=torch.uint8, device=device)
            if pin and device.type == "cpu":
                from zero_core.accelerator import get_accelerator

                new = get_accelerator().pin_memory(new)
            new.copy_(
                torch.empty(0, dtype=torch.uint8, device=old.device).set_(old), non_blocking=non_blocking
            )
            storage = new.untyped_storage()
            for t in group:
                t.data = torch.empty(0, dtype=t.dtype, device=device).set_(
                    storage, t.storage_offset(), t.size(), t.stride()
                )


class ModelStates:
    """The state behind ``engine.offload_states()`` / ``reload_states()``: held by the engine
    (``engine._model_states``), which delegates those calls here with its strategy.
    See [Note: offloading model states between phases]."""

    def __init__(self) -> None:
        self.offloaded: dict[str, torch.device] | None = None

    def offload(
        self,
        strategy: TrainingStrategy,
        stage: int,
        home: torch.device,
        include: Iterable[Any] | None = None,
        device: torch.device | str = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the model states of ``include`` (default: all kinds) to host memory (ZeRO stage 3)."""
        if stage != 3:
            raise NotImplementedError(
                f"offload_states: moving model states is supported for ZeRO stage 3 only (as in DeepSpeed); "
                f"this engine runs stage {stage}"
            )
        dev = str(getattr(device, "value", device))
        if dev != "cpu":
            raise ValueError(f"offload_states: device must be 'cpu' (OffloadDeviceEnum.cpu), got {device!r}")
        offloads_optimizer = not isinstance(strategy.offload, NoOptimizerOffload)
        if offloads_optimizer or strategy.param_offload.transient:  # See [Note: shard store seam]
            raise ValueError(
                "offload_states: the config offloads the optimizer or the parameters already "
                "(zero_optimization.offload_optimizer / offload_param); those states live off the device "
                "under their own management"
            )
        kinds = list(STATE_KINDS) if include is None else [_kind_name(k) for k in include]
        if self.offloaded:
            already = sorted(set(kinds) & set(self.offloaded))
            if already:
                raise RuntimeError(
                    f"offload_states: {already} are offloaded already; call reload_states() first"
                )
        release = getattr(strategy, "empty_partition_cache", None)
        if release is not None:
            release()  # gathered copies: re-gathered on reload
        target = torch.device("cpu")
        home = torch.device(home)
        # one pass, so a storage shared by two kinds (fp32 master == shard) is copied once
        everything = [t for kind in STATE_KINDS for t in _state_tensors(strategy, kind)]
        chosen = [t for kind in kinds for t in _state_tensors(strategy, kind)]
        _move_storages(chosen, everything, target, bool(pin_memory), bool(non_blocking))
        self.offloaded = {**(self.offloaded or {}), **{k: home for k in kinds}}

    def reload(self, strategy: TrainingStrategy, non_blocking: bool = False) -> None:
        """Bring back every state :meth:`offload` moved, to the device it came from."""
        if not self.offloaded:
            return
        everything = [t for kind in STATE_KINDS for t in _state_tensors(strategy, kind)]
        homes: dict[torch.device, list[torch.Tensor]] = {}
        for kind, home in self.offloaded.items():
            homes.setdefault(home, []).extend(_state_tensors(strategy, kind))
        for home, chosen in homes.items():
            _move_storages(chosen, everything, home, False, bool(non_blocking))
        self.offloaded = None
        strategy.refresh_persistent()

    def require_on_device(self, what: str, kinds: tuple[str, ...] = STATE_KINDS) -> None:
        if self.offloaded and set(kinds) & set(self.offloaded):
            raise RuntimeError(
                f"engine.{what}: model states {sorted(self.offloaded)} are offloaded "
                "(engine.offload_states()); call engine.reload_states() first"
            )


def _state_tensors(s: Stage3Strategy, kind: str) -> list[torch.Tensor]:
    """The tensors of ``kind`` in the stage 3 strategy ``s``."""
    if kind == "lp_params":
        return [st.shard for st in s.records]
    if kind == "hp_params":
        return list(s.master.values())
    if kind == "optim_states":
        return [t for st in s.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    if kind == "lp_grads":
        return [st.grad_shard for st in s.records if st.grad_shard is not None]
    return []  # contiguous_grad_buffer: none persists (see the Note)
