"""Where ``initialize`` meets an experiment of the autotuner (``zero run --autotuning``).

The autotuner is zero-profiler's (``zero_profiler.autotuning``, its ``autotuning`` extra): it
launches the user's script with a config whose ``autotuning`` section holds ``enabled: true`` and
a ``metric_path``, and zero-profiler's step hook measures that run and ends it ([Note: autotuning
experiments] in ``zero_profiler/autotuning/engine_hook.py``). zero-core keeps only the seam, so a
config with an ``autotuning`` section loads and trains with zero-core alone:

* :func:`experiment_baseline` is taken at the start of ``initialize``, before anything is built:
  the memory the process holds less the model's own tensors, and the model's parameter counts
  (the hook reports the memory training added over that baseline);
* :func:`attach_experiment_hook`, once the engine is built: without the section, or with
  ``enabled: false``, nothing. ``enabled`` without ``metric_path`` (a DeepSpeed job's config,
  copied) trains normally with a warning that the search is run by ``zero run --autotuning``
  (none inside the search's own launches, which set :data:`EXPERIMENT_ENV`); zero-profiler is not
  needed. With a ``metric_path`` zero-profiler's hook joins the engine's step hooks, found through
  ``plugins.require`` (a missing zero-profiler is an error naming what to install).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zero_core import plugins

if TYPE_CHECKING:
    from zero_core.config import ZeroConfig
    from zero_core.engine.engine import ZeroEngine

#: the environment variable the autotuner sets on its experiments (the value: the experiment's name)
EXPERIMENT_ENV = "ZERO_AUTOTUNING_EXPERIMENT"


@dataclass(frozen=True)
class ExperimentBaseline:
    """What the process held before ``initialize`` built anything (see the module docstring)."""

    process_bytes: int = 0
    model_counts: dict[str, int] = field(default_factory=dict)


def process_baseline_bytes(model: torch.nn.Module) -> int:
    """On the CPU accelerator: the RSS the process holds now, less the model's own tensors (0 on
    other accelerators)."""
    from zero_core.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device(acc.current_device()).type != "cpu":
        return 0
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return max(0, acc.memory_allocated() - held)


def model_info(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts of ``model``: full sizes, also of ZeRO-3 partitioned parameters (``ds_numel``)."""
    params = list(model.parameters())

    def numel(p: torch.nn.Parameter) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    return {
        "num_params": sum(numel(p) for p in params),
        "trainable_num_params": sum(numel(p) for p in params if p.requires_grad),
    }


def experiment_baseline(model: torch.nn.Module) -> ExperimentBaseline:
    """Taken at the start of ``initialize``, before anything is built."""
    return ExperimentBaseline(process_baseline_bytes(model), model_info(model))


def attach_experiment_hook(cfg: ZeroConfig, engine: ZeroEngine, baseline: ExperimentBaseline) -> None:
    """Add the autotuning experiment's step hook to ``engine`` when the config asks for one.

    With ``autotuning.model_info.profile`` zero-profiler's hook writes the model information and
    ends the process here."""
    section = getattr(cfg, "autotuning", None)
    if section is None or not getattr(section, "enabled", False):
        return
    if not section.metric_path:
        if not os.environ.get(EXPERIMENT_ENV):
            warnings.warn(
                "autotuning.enabled is set, but the search is run by `zero run --autotuning tune|run "
                "SCRIPT ...`; this run trains normally",
                UserWarning,
                stacklevel=3,
            )
        return
    hooks = plugins.require(
        "zero_profiler.autotuning.engine_hook",
        "autotuning.metric_path (an experiment of zero run --autotuning)",
        extra="autotuning",
    )
    hook = hooks.build_autotuning_hook(section, engine, baseline.model_counts, baseline.process_bytes)
    engine._step_hooks.append(hook)
