"""``zero.MiCS_Init``: DeepSpeed's MiCS construction context, not implemented here.

MiCS (arXiv 2205.00119) partitions ZeRO-3 states over sub-groups of ``mics_shard_size`` ranks
and replicates across them. This release partitions over the whole data-parallel group only
(``zero.Init``). The name exists so a script that uses it fails at the call with what is
missing and what to use instead, rather than with an AttributeError on the module.
"""

from __future__ import annotations

from typing import Any


class MiCS_Init:  # noqa: N801 (DeepSpeed's public name)
    """Raises :class:`NotImplementedError`: MiCS is not implemented; use ``zero.Init``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "zero.MiCS_Init: MiCS (ZeRO-3 sharded over groups of mics_shard_size ranks, arXiv 2205.00119) "
            "is not implemented in this release. Use zero.Init, which partitions over the whole "
            "data-parallel group (the same training result, more communication across nodes)"
        )
