"""ZeRO stage 3: partitioned parameters (see [Note: stage 3 parameter layout] in
``partitioned_param.py``), ``Init``, ``GatheredParameters``, external parameters, ``TiledLinear``
and the :class:`Stage3Strategy` the engine uses for ``zero_optimization.stage = 3``."""

from zero_core.zero.stage3.external_params import register_external_parameter, unregister_external_parameter
from zero_core.zero.stage3.gathered_parameters import GatheredParameters
from zero_core.zero.stage3.init_context import Init
from zero_core.zero.stage3.partitioned_param import (
    Stage3CollectiveError,
    is_partitioned,
    set_collective_checks,
    set_collective_timeout,
)
from zero_core.zero.stage3.strategy import Stage3Strategy
from zero_core.zero.stage3.tiled_linear import TiledLinear

__all__ = [
    "GatheredParameters",
    "Init",
    "Stage3CollectiveError",
    "Stage3Strategy",
    "TiledLinear",
    "is_partitioned",
    "register_external_parameter",
    "set_collective_checks",
    "set_collective_timeout",
    "unregister_external_parameter",
]
