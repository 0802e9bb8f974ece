"""Cartesian process topologies: which global rank owns which (pipe, data, model) coordinate.

A topology is a pure mapping (no communication): an n-dimensional grid whose axes are named,
laid out row-major in the order of ``axes`` so that the *last* axis varies fastest between
adjacent ranks. :class:`PipelineParallelGrid` builds the process groups of a topology.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

from zero_pipe import _dist


class ProcessTopology:
    """Map n-dimensional Cartesian coordinates to linear ranks and back.

    ``ProcessTopology(axes=['x', 'y'], dims=[2, 3])`` gives ranks ``0..5``; coordinates
    ``(x, y)`` and ``(x, y + 1)`` are adjacent ranks (row-major in the order of ``axes``).
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes = list(axes)
        dims = list(dims)
        if not axes:
            raise ValueError("ProcessTopology: axes must name at least one axis, got []")
        if len(axes) != len(dims):
            raise ValueError(
                f"ProcessTopology: axes {axes} and dims {dims} must have the same length "
                f"({len(axes)} != {len(dims)})"
            )
        for axis in axes:
            if not isinstance(axis, str) or not axis.isidentifier():
                raise ValueError(f"ProcessTopology: axis name {axis!r} must be a Python identifier string")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be unique, got {axes}")
        for axis, dim in zip(axes, dims):
            if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
                raise ValueError(f"ProcessTopology: dim of axis {axis!r} must be an int >= 1, got {dim!r}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        # Row-major enumeration: itertools.product varies the last axis fastest.
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(itertools.product(*(range(d) for d in dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank
        self._coords = {rank: coord for coord, rank in self.mapping.items()}

    def __repr__(self) -> str:
        return f"ProcessTopology(axes={self.axes}, dims={self.dims})"

    def world_size(self) -> int:
        """Total number of ranks in the grid."""
        return len(self.mapping)

    def _check_axis(self, axis: str) -> None:
        if axis not in self.axes:
            raise ValueError(f"ProcessTopology: unknown axis {axis!r}; axes are {self.axes}")

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size():
            raise ValueError(
                f"ProcessTopology: rank must be an int in [0, {self.world_size()}), got {rank!r}"
            )

    def get_rank(self, **coord_kwargs: int) -> int:
        """Global rank of the process at the coordinate given as keyword arguments (all axes)."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(
                f"ProcessTopology.get_rank: give exactly the axes {self.axes}, got {sorted(coord_kwargs)}"
            )
        for axis, dim in zip(self.axes, self.dims):
            idx = coord_kwargs[axis]
            if not isinstance(idx, int) or not 0 <= idx < dim:
                raise ValueError(f"ProcessTopology.get_rank: {axis}={idx!r} is outside [0, {dim})")
        return self.mapping[self.ProcessCoord(**coord_kwargs)]

    def get_axis_names(self) -> list[str]:
        """Axis names in the order of the layout."""
        return list(self.axes)

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """String of the coordinate of ``rank``, e.g. ``'a_01-b_01'``; used in checkpoint names."""
        self._check_rank(rank)
        omit = set(omit_axes)
        coord = self.get_coord(rank)
        parts = [f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit]
        return outer_sep.join(parts)

    def get_dim(self, axis: str) -> int:
        """Number of processes along ``axis``; 0 when the topology has no such axis."""
        if axis not in self.axes:
            return 0
        return self.dims[self.axes.index(axis)]

    def get_coord(self, rank: int):
        """The ``ProcessCoord`` namedtuple owned by ``rank``."""
        self._check_rank(rank)
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Rank lists for communicators along ``axis``: each list varies ``axis`` only.

        Returns ``[]`` when the topology has no such axis.
        """
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for other_coord in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, other_coord))
            ranks = [self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))]
            lists.append(ranks)
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinates match every ``axis=index`` criterion given."""
        for axis in filter_kwargs:
            self._check_axis(axis)
        return [
            rank
            for coord, rank in sorted(self.mapping.items(), key=lambda kv: kv[1])
            if all(getattr(coord, axis) == idx for axis, idx in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Global ranks whose coordinate along ``axis`` is ``idx``."""
        self._check_axis(axis)
        return self.filter_match(**{axis: idx})


class PipeDataParallelTopology(ProcessTopology):
    """Hybrid pipeline + data parallelism: ``axes=['pipe', 'data']``.

    Data is the fastest axis, so the data-parallel replicas of a stage are adjacent ranks
    (gradient all-reduce stays within a node when possible).
    """

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """3D parallelism: ``axes=['pipe', 'data', 'model']`` (model = tensor parallel, fastest)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """The process groups of a topology as seen from this rank.

    Every rank must construct the grid (``new_group`` is collective), in the same order.
    Exposes the stage id, the data-parallel id and group, the pipeline group (all stages
    of this rank's pipeline), and the ranks of the neighbouring stages.
    """

    def __init__(self, topology: ProcessTopology, rank: int | None = None) -> None:
        if not isinstance(topology, ProcessTopology):
            raise TypeError(f"PipelineParallelGrid: topology must be a ProcessTopology, got {type(topology)}")
        if "pipe" not in topology.axes or "data" not in topology.axes:
            raise ValueError(
                f"PipelineParallelGrid: topology needs 'pipe' and 'data' axes, got {topology.axes}"
            )
        world = _dist.get_world_size() if rank is None else topology.world_size()
        if world != topology.world_size():
            raise ValueError(
                f"PipelineParallelGrid: topology has {topology.world_size()} ranks but the world size is {world}"
            )
        self.topology = topology
        self.global_rank = _dist.get_rank() if rank is None else rank
        coord = topology.get_coord(self.global_rank)
        self.stage_id: int = coord.pipe
        self.data_parallel_id: int = coord.data
        self.pipe_parallel_size = topology.get_dim("pipe")
        self.data_parallel_size = topology.get_dim("data")
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.dp_group = None
        self.pp_group = None
        self.dp_ranks: list[int] = []
        self.pp_ranks: list[int] = []
        for ranks in topology.get_axis_comm_lists("data"):
            group = _dist.new_group(ranks) if rank is None else None
            if self.global_rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks
        for ranks in topology.get_axis_comm_lists("pipe"):
            group = _dist.new_group(ranks) if rank is None else None
            if self.global_rank in ranks:
                self.pp_group, self.pp_ranks = group, ranks

    def stage_to_global(self, stage_id: int) -> int:
        """Global rank of ``stage_id`` in this rank's pipeline (same data/model coordinates)."""
        if not 0 <= stage_id < self.pipe_parallel_size:
            raise ValueError(f"stage_to_global: stage_id {stage_id} outside [0, {self.pipe_parallel_size})")
        return self.pp_ranks[stage_id]

    @property
    def prev_stage_rank(self) -> int | None:
        return self.stage_to_global(self.stage_id - 1) if self.stage_id > 0 else None

    @property
    def next_stage_rank(self) -> int | None:
        last = self.pipe_parallel_size - 1
        return self.stage_to_global(self.stage_id + 1) if self.stage_id < last else None
