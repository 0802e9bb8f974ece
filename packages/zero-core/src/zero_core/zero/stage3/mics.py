"""``zero.MiCS_Init``: ``zero.Init`` that partitions over MiCS's shard groups.

MiCS (arXiv 2205.00119) shards ZeRO-3 model states over groups of ``mics_shard_size`` ranks and
replicates them across the groups (see [Note: MiCS and hpZ shard groups]). A model built under
``zero.MiCS_Init`` is cut to those shards as it is constructed, so the engine, given the same
config, uses the parameters as they are. Parameters take global rank 0's values on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.zero.stage3.init_context import Init
from zero_core.zero.stage3.partitioned_param import partition_on_route


class MiCS_Init(Init):  # noqa: N801 (DeepSpeed's public name)
    """``zero.Init`` over the shard groups of ``zero_optimization.mics_shard_size``.

    Takes ``zero.Init``'s arguments; ``config_dict_or_path`` (or ``config``) is required and must
    set ``mics_shard_size`` (>= 1, dividing the world size). The data-parallel group must be the
    whole world.
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        *args: Any,
        config_dict_or_path: Any = None,
        config: Any = None,
        **kwargs: Any,
    ) -> None:
        from zero_core.zero.stage3.init_context import _load_cfg
        from zero_core.zero.stage3.shard_groups import build_route

        cfg = _load_cfg(config_dict_or_path, config)
        if (
            cfg is None or cfg.zero_optimization.mics_shard_size < 1
        ):  # checked before Init would start torch.distributed
            raise ValueError(
                "zero.MiCS_Init: the config must set zero_optimization.mics_shard_size >= 1 "
                "(pass it as config_dict_or_path=, the same config as zero.initialize's)"
            )
        # Convert after the route exists: Init converts ``module`` in its own __init__.
        super().__init__(
            None, data_parallel_group, *args, config_dict_or_path=config_dict_or_path, config=config, **kwargs
        )
        zc = cfg.zero_optimization
        self.route = build_route(
            self.group, int(zc.mics_shard_size), bool(zc.mics_hierarchical_params_gather)
        )
        if self.enabled and module is not None:
            self._convert(module)

    def _partition(self, param: torch.nn.Parameter) -> None:
        if self.route is None:  # a world of one rank: plain partitioning
            super()._partition(param)
        else:
            partition_on_route(param, self.route)
