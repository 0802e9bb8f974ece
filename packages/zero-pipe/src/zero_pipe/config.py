"""The ``pipeline`` section of the config, owned by zero-pipe.

Registered with zero-core through the ``zero.config_sections`` entry point (see
[Note: config sections] in ``zero_core/config/sections.py``), so ``cfg.pipeline`` is an instance
of :class:`PipelineSectionConfig` once zero-pipe is installed. Unlike zero-core's permissive
built-in model, unknown keys are errors here.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator
from zero_core.config.base import ConfigModel, NonNegInt


def _stages(value: object) -> object:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    if isinstance(value, float) and value.is_integer() and value >= 1:
        return int(value)
    raise ValueError(f'pipeline.stages: {value!r} is not "auto" or an integer >= 1')


class PipelineSectionConfig(ConfigModel):
    """``pipeline``: checked against the PipelineModule by ``initialize_pipeline``.

    * ``stages``: ``"auto"`` (take the module's) or the number of stages the module must have;
    * ``partition``: DeepSpeed's key, informational (the module's ``partition_method`` decides);
    * ``seed_layers``: informational, as above;
    * ``activation_checkpoint_interval``: applied when the module was built with 0;
    * ``pipe_partitioned`` / ``grad_partitioned``: DeepSpeed splits activations/gradients over
      tensor-parallel ranks; accepted, and a no-op without a model-parallel axis;
    * ``lookahead`` (zero-specific): extra warm-up forwards of every stage but the last in the 1F1B
      schedule, to hide message latency at the cost of that many more micro-batches of
      activations (see [Note: 1F1B lookahead] in ``schedule.py``); 0, the default, is DeepSpeed's order.
    """

    config_path: ClassVar[str] = "pipeline"

    stages: Annotated[int | Literal["auto"], BeforeValidator(_stages)] = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: NonNegInt = 0
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    lookahead: NonNegInt = 0
