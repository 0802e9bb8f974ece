"""The training engine's entry point: the ``flops_profiler`` config section, applied per step.

The engine (zero-core) creates one :class:`StepProfiler` when the section is present and zero-profiler
is installed, and calls ``on_step_begin(step)`` before the forward of each global step and
``on_step_end(step)`` after the optimizer step. At ``profile_step`` the whole step (forward,
backward, recomputation) is counted and the profile is printed (or written to ``output_file``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from zero_profiler.profiler import FlopsProfiler

_KEYS = {
    "enabled",
    "recompute_fwd_factor",
    "profile_step",
    "module_depth",
    "top_modules",
    "detailed",
    "output_file",
}


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """DeepSpeed's ``flops_profiler`` section, with its defaults."""

    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None

    @classmethod
    def from_section(cls, section: object) -> FlopsProfilerConfig:
        """From a dict, a pydantic model (``model_dump``) or any object with these attributes."""
        if section is None:
            return cls()
        if isinstance(section, FlopsProfilerConfig):
            return section
        if hasattr(section, "model_dump"):
            section = section.model_dump()
        if not isinstance(section, Mapping):
            section = {k: getattr(section, k) for k in _KEYS if hasattr(section, k)}
        unknown = set(section) - _KEYS
        if unknown:
            raise ValueError(f"flops_profiler: unknown keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
        cfg = cls(**dict(section))
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.enabled, bool):
            raise ValueError(f"flops_profiler.enabled must be true or false, got {self.enabled!r}")
        if not isinstance(self.detailed, bool):
            raise ValueError(f"flops_profiler.detailed must be true or false, got {self.detailed!r}")
        if not is_int(self.profile_step) or self.profile_step < 0:
            raise ValueError(f"flops_profiler.profile_step must be an int >= 0, got {self.profile_step!r}")
        if not is_int(self.module_depth) or self.module_depth < -1:
            raise ValueError(
                f"flops_profiler.module_depth must be -1 or an int >= 0, got {self.module_depth!r}"
            )
        if not is_int(self.top_modules) or self.top_modules < 1:
            raise ValueError(f"flops_profiler.top_modules must be an int >= 1, got {self.top_modules!r}")
        if isinstance(self.recompute_fwd_factor, bool) or not isinstance(
            self.recompute_fwd_factor, (int, float)
        ):
            raise ValueError(
                f"flops_profiler.recompute_fwd_factor must be a number, got {self.recompute_fwd_factor!r}"
            )
        if not 0.0 <= self.recompute_fwd_factor <= 1.0:
            raise ValueError(
                f"flops_profiler.recompute_fwd_factor must be in [0, 1], got {self.recompute_fwd_factor}"
            )
        if self.output_file is not None and not isinstance(self.output_file, str):
            raise ValueError(
                f"flops_profiler.output_file must be a path string or null, got {self.output_file!r}"
            )


class StepProfiler:
    """Profiles one training step of ``model`` as the ``flops_profiler`` section asks.

    Args:
        model: the module the engine trains.
        config: the ``flops_profiler`` section (dict, pydantic model or :class:`FlopsProfilerConfig`).
        engine: the engine itself, for world sizes and micro-batch size in the header (optional).
        rank: only this process's rank 0 prints (pass the global rank; default 0).
    """

    def __init__(
        self, model: torch.nn.Module, config: object, engine: torch.nn.Module | None = None, rank: int = 0
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"StepProfiler: model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = FlopsProfilerConfig.from_section(config)
        self.model = model
        self.rank = rank
        self.profiler = FlopsProfiler(
            model, ds_engine=engine, recompute_fwd_factor=self.config.recompute_fwd_factor
        )
        self.profiler.track_backward = True  # the engine runs backward inside the profiled step
        self.last_profile: str | None = None  # text of the last printed profile
        # FLOPs of the last profiled step, forward and backward (the autotuner's metric "flops")
        self.last_step_flops: int | None = None
        self._optimizer_started: float | None = None

    def active(self, step: int) -> bool:
        return self.config.enabled and step == self.config.profile_step

    def on_step_begin(self, step: int) -> None:
        """Call before the forward pass of global step ``step``."""
        if self.active(step):
            self.profiler.start_profile()

    def on_optimizer_step_begin(self, step: int) -> None:
        """Optional: call just before ``optimizer.step()`` so the profile reports step latency."""
        if self.active(step) and self.profiler.started:
            self._optimizer_started = time.perf_counter()

    def on_step_end(self, step: int) -> None:
        """Call after the optimizer step of global step ``step``; prints the profile at ``profile_step``."""
        if not (self.active(step) and self.profiler.started):
            return
        if self._optimizer_started is not None:
            self.profiler.step_latency = time.perf_counter() - self._optimizer_started
        self.profiler.stop_profile()
        self.last_step_flops = int(self.profiler.get_total_train_flops())  # forward + backward
        cfg = self.config
        self.last_profile = self.profiler.model_profile_text(
            step, cfg.module_depth, cfg.top_modules, cfg.detailed
        )
        if self.rank == 0:
            self.profiler.print_model_profile(
                step, cfg.module_depth, cfg.top_modules, cfg.detailed, cfg.output_file
            )
        self.profiler.end_profile()
        self._optimizer_started = None
