"""DeepSpeed's engine accessors: ``engine.zero_optimization_stage()``, ``engine.bfloat16_enabled()`` ...

[Note: DeepSpeed engine accessors]
DeepSpeed training scripts ask the engine about the run instead of re-reading their config
(``if engine.bfloat16_enabled(): ...``, ``engine.zero_optimization_stage() == 3``,
``engine.local_rank``), so a script ported to zero needs the same names. They are read-only
views of the resolved config and of the engine's state, kept here so ``engine.py`` holds the
training loop only. ``set_gradient_accumulation_boundary`` is the one that changes behaviour:
like DeepSpeed's, it overrides the micro-step count's boundary decision until reset with None.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from zero_core import comm
from zero_core.engine.strategy_factory import COMM_DTYPES

if TYPE_CHECKING:
    from zero_core.config import ZeroConfig


class DeepSpeedAccessors:
    """Mixed into :class:`~zero_core.engine.engine.ZeroEngine`. See [Note: DeepSpeed engine accessors].

    A public-API facade, deliberately a mixin (as FSDP2's ``FSDPModule`` gives a sharded module
    ``reshard()``/``unshard()``): DeepSpeed's users call these names on the engine itself
    (``engine.bfloat16_enabled()``), so they must be methods of the engine's class; a part held by
    the engine would need one forwarding method per name (about thirty of them) to keep them
    there. It owns no state (two class-level defaults aside), only reads the engine's config and
    step results, and no other class mixes it in. The engine's parts that own state and
    behaviour (strategy, boundary step, ``NoSyncGuard``, ``ModelStates``) are held, not mixed in.
    """

    config: ZeroConfig
    compute_dtype: torch.dtype
    _global_grad_norm: float | None
    _wall_clock: bool
    _boundary_override: bool | None = None
    _step_applied: bool = False

    # -- batch sizes and the step ------------------------------------------------------------
    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return int(self.config.gradient_accumulation_steps)

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping or 0.0)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]  # type: ignore[attr-defined]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (before clipping), or None before any step.

        Kept on the device by the step and read to the host here, on first access."""
        if isinstance(self._global_grad_norm, torch.Tensor):
            self._global_grad_norm = float(self._global_grad_norm)
        return self._global_grad_norm

    # -- ZeRO -------------------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    def zero_optimization(self) -> bool:
        """Whether ZeRO partitions anything (stage > 0)."""
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state lives in CPU memory (``offload_optimizer.device: cpu``)."""
        return self.config.zero_optimization.offload_optimizer_device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self.config.zero_optimization.gather_16bit_weights_on_model_save)

    # -- precision and communication ----------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def amp_enabled(self) -> bool:
        return bool(self.config.amp.enabled)

    def get_type(self) -> torch.dtype:
        """The dtype the model computes in."""
        return self.compute_dtype

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: ``communication_data_type``, else the compute dtype."""
        name = self.config.communication_data_type
        return COMM_DTYPES[name] if name is not None else self.compute_dtype

    def gradient_predivide_factor(self) -> float:
        return float(self.config.gradient_predivide_factor)

    # -- reporting ----------------------------------------------------------------------------
    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._wall_clock

    # -- progressive layer drop (See [Note: progressive layer drop]) -------------------------
    def get_pld_theta(self) -> float | None:
        """The keep probability the next training forward receives; None with the section off."""
        pld = getattr(self, "progressive_layer_drop", None)
        return None if pld is None else pld.get_theta()

    def pld_enabled(self) -> bool:
        return bool(self.config.progressive_layer_drop.enabled)

    def pld_params(self) -> dict[str, float]:
        section = self.config.progressive_layer_drop
        return {"theta": float(section.theta), "gamma": float(section.gamma)}

    def pld_theta(self) -> float:
        return self.pld_params()["theta"]

    def pld_gamma(self) -> float:
        return self.pld_params()["gamma"]

    def get_mom(self) -> list[Any]:
        """Each parameter group's ``betas`` (Adam family) or ``momentum`` (SGD), as DeepSpeed reports."""
        groups = self.optimizer.param_groups  # type: ignore[attr-defined]
        return [g["betas"] if "betas" in g else g.get("momentum", 0.0) for g in groups]

    # -- processes ----------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``, set by ``zero run``/torchrun)."""
        raw = os.environ.get("LOCAL_RANK", "")
        return int(raw) if raw.isdigit() else 0

    @property
    def world_size(self) -> int:
        return comm.get_world_size() if comm.is_initialized() else 1

    @property
    def mp_world_size(self) -> int:
        """Model-parallel degree: 1 (this engine has no tensor or pipeline parallelism)."""
        return 1

    # -- the step -----------------------------------------------------------------------------
    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the weights (False when fp16 overflow skipped it)."""
        return self._step_applied

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force whether the next ``backward``/``step`` ends an accumulation window (None: count micro-steps).

        For loops that decide the boundary themselves (a last, short accumulation window).
        """
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(
                f"set_gradient_accumulation_boundary: expected a bool or None, got {is_boundary!r}"
            )
        self._boundary_override = is_boundary

    def save_fp16_model(
        self,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Deprecated DeepSpeed name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)  # type: ignore[attr-defined]
