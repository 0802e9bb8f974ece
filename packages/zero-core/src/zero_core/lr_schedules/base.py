"""``_Schedule``, the step/state logic every schedule shares, and the helpers that turn its state into plain
JSON data and back. See [Note: scheduler state is a function of last_batch_iteration] in ``__init__.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from zero_core.lr_schedules.validation import _check_int, _param_groups


class _Schedule:
    """Shared step/state logic. See [Note: scheduler state is a function of last_batch_iteration]."""

    # Attribute names saved by state_dict() (besides last_batch_iteration); plain JSON data only.
    _state_keys: tuple[str, ...] = ()

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int) -> None:
        self._owner = type(self).__name__
        self.optimizer = optimizer
        _param_groups(optimizer, self._owner)  # a clear error now for something without param groups
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, self._owner, -1)
        self._last_lr: list[float] = []

    @property
    def _groups(self) -> list[dict]:
        """The optimizer's param groups, looked up at each use (not kept): ``optimizer.load_state_dict``
        replaces the group dicts, and a scheduler writing into the old ones would no longer change the
        learning rate the optimizer uses."""
        return _param_groups(self.optimizer, self._owner)

    def get_lr(self) -> list[float]:
        """Learning rate of every param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def _apply(self) -> None:
        for group, lr in zip(self._groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self._groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next batch (or jump to ``last_batch_iteration``) and update the optimizer."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, self._owner, -1)
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The learning rates last written into the optimizer."""
        if not self._last_lr:
            raise RuntimeError(f"{self._owner}: get_last_lr() called before the scheduler set any rate")
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        state = {key: _plain(getattr(self, key)) for key in self._state_keys}
        return {"type": self._owner, "last_batch_iteration": self.last_batch_iteration, **state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "last_batch_iteration" not in state_dict:
            raise ValueError(f"{self._owner}.load_state_dict: expected a dict with 'last_batch_iteration'")
        kind = state_dict.get("type", self._owner)
        if kind != self._owner:
            raise ValueError(f"{self._owner}.load_state_dict: the state is of a {kind} scheduler")
        for key in self._state_keys:
            if key in state_dict:
                value = state_dict[key]
                current = getattr(self, key)
                if isinstance(current, list) and len(value) != len(current):
                    raise ValueError(
                        f"{self._owner}.load_state_dict: '{key}' has {len(value)} entries, "
                        f"the optimizer has {len(current)} param groups"
                    )
                setattr(self, key, _restore(value, current))
        self.last_batch_iteration = _check_int(
            "last_batch_iteration", state_dict["last_batch_iteration"], self._owner, -1
        )
        self._apply()


def _plain(value: object) -> object:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _restore(value: Any, like: Any) -> Any:
    """Give JSON-decoded lists back the tuple shape of the attribute they replace (momentum pairs)."""
    if isinstance(like, list) and like and isinstance(like[0], tuple):
        return [tuple(v) for v in value]
    return value
