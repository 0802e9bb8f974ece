"""Progressive layer drop: the keep-probability schedule the engine hands to the model's forward.

[Note: progressive layer drop]
Progressive Layer Dropping (Zhang and He, "Accelerating Training of Transformer-Based Language
Models with Progressive Layer Dropping", NeurIPS 2020) trains a model that skips layers at
random with a keep probability that starts at 1 and decays towards ``theta``:

    theta(t) = (1 - theta) * exp(-gamma * t) + theta

DeepSpeed's ``progressive_layer_drop`` section (``enabled``, ``theta``, ``gamma``) drives it the
way we do here; the dropping itself is the model's (DeepSpeed's BERT example reads the two
arguments), the engine only schedules it:

* While the module is in training mode, every forward through the engine gets the keyword
  arguments ``progressive_layer_drop=True, pld_theta=<current theta>``. A model whose forward
  takes neither raises Python's own TypeError, as under DeepSpeed: the section is for models
  written for it. Evaluation forwards (``module.eval()``) get nothing.
* The current theta is 1.0 until the first optimizer step; at each gradient-accumulation
  boundary, before the step, it becomes ``theta(global_steps)`` with the step counter before
  the increment, so the forwards of step ``t >= 1`` use ``theta(t - 1)``. ``exp`` is numpy's,
  so the values are DeepSpeed's to the last bit.
* ``engine.get_pld_theta()`` returns the current theta (None with the section off), and
  ``engine.progressive_layer_drop`` is the :class:`ProgressiveLayerDrop` (DeepSpeed's names).
* After ``load_checkpoint`` the schedule follows the restored step counter (theta of
  ``global_steps - 1``), so a resumed run uses the thetas an uninterrupted one would; DeepSpeed
  restarts from 1.0 until the next step.
* The pipeline engine cannot pass keyword arguments to a ``PipelineModule``'s stages (neither
  can DeepSpeed's: its forward then fails with a TypeError), so zero-pipe refuses the section.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from zero_core.config import ZeroConfig


class ProgressiveLayerDrop:
    """DeepSpeed's PLD schedule object: ``update_state(global_step)``, ``get_theta()``, ``get_state()``.

    See [Note: progressive layer drop]. ``theta`` is the final keep probability (in [0, 1]),
    ``gamma`` (>= 0) how fast the keep probability falls towards it.
    """

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        for name, value in (("theta", theta), ("gamma", gamma)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise TypeError(f"ProgressiveLayerDrop: {name} must be a finite number, got {value!r}")
        if not 0.0 <= theta <= 1.0:
            raise ValueError(f"ProgressiveLayerDrop: theta is a keep probability in [0, 1], got {theta!r}")
        if gamma < 0:
            raise ValueError(f"ProgressiveLayerDrop: gamma must be >= 0, got {gamma!r}")
        self.theta = float(theta)
        self.gamma = float(gamma)
        self.current_theta = 1.0

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments a training forward receives."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        """Set the current theta to the schedule's value at ``global_step``."""
        if isinstance(global_step, bool) or not isinstance(global_step, (int, np.integer)) or global_step < 0:
            raise ValueError(
                f"ProgressiveLayerDrop.update_state: global_step must be an int >= 0, got {global_step!r}"
            )
        decay = np.exp(-self.gamma * int(global_step))  # numpy's exp: DeepSpeed's values exactly
        self.current_theta = float((1.0 - self.theta) * decay + self.theta)

    def resume_at(self, global_steps: int) -> None:
        """The state after ``global_steps`` optimizer steps (a restored checkpoint's counter)."""
        if global_steps > 0:
            self.update_state(global_steps - 1)
        else:
            self.current_theta = 1.0


def build_progressive_layer_drop(config: ZeroConfig) -> ProgressiveLayerDrop | None:
    """The schedule of the config's ``progressive_layer_drop`` section, None when it is off."""
    section = getattr(config, "progressive_layer_drop", None)
    if section is None or not getattr(section, "enabled", False):
        return None
    return ProgressiveLayerDrop(theta=section.theta, gamma=section.gamma)
