"""The ``CommBackend`` protocol: the collectives the project relies on.

The module ``zero_core.comm`` is the implementation (``isinstance(zero_core.comm,
CommBackend)`` holds): its functions mirror ``torch.distributed`` names and arguments, work
around backend gaps (see [Note: backend workarounds] in ``zero_core.comm.collectives``) and
are recorded by ``zero_core.comm.comms_logger``. The protocol exists so that code wanting to
substitute another transport (a fake for unit tests, a different library) has a precise
target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zero_core.comm.p2p import P2POp
    from zero_core.comm.work import Work


@runtime_checkable
class CommBackend(Protocol):
    def is_initialized(self) -> bool: ...

    def get_rank(self, group: dist.ProcessGroup | None = None) -> int: ...

    def get_world_size(self, group: dist.ProcessGroup | None = None) -> int: ...

    def new_group(self, ranks: list[int] | None = None, **kwargs: Any) -> dist.ProcessGroup: ...

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = ...,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Work | None: ...

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = ...,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Work | None: ...

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Work | None: ...

    def broadcast(
        self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Work | None: ...

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Work | None: ...

    def send(
        self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0
    ) -> None: ...

    def recv(
        self,
        tensor: torch.Tensor,
        src: int | None = None,
        group: dist.ProcessGroup | None = None,
        tag: int = 0,
    ) -> int: ...

    def isend(
        self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0
    ) -> Work: ...

    def irecv(
        self,
        tensor: torch.Tensor,
        src: int | None = None,
        group: dist.ProcessGroup | None = None,
        tag: int = 0,
    ) -> Work: ...

    def batch_isend_irecv(self, p2p_op_list: list[P2POp | dist.P2POp]) -> list[Work]: ...

    def barrier(self, group: dist.ProcessGroup | None = None) -> None: ...
