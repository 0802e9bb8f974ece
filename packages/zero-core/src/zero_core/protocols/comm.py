"""The ``CommBackend`` protocol: the collectives the project relies on.

The module ``zero_core.comm`` is the implementation (``isinstance(zero_core.comm,
CommBackend)`` holds): its functions mirror ``torch.distributed`` names and arguments, work
around backend gaps (see [Note: backend workarounds] in ``zero_core.comm.collectives``) and
are recorded by ``zero_core.comm.comms_logger``. The protocol exists so that code wanting to
substitute another transport (a fake for unit tests, a different library) has a precise
target.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class CommBackend(Protocol):
    def is_initialized(self) -> bool: ...

    def get_rank(self, group: Any = None) -> int: ...

    def get_world_size(self, group: Any = None) -> int: ...

    def new_group(self, ranks: list[int] | None = None, **kwargs: Any) -> Any: ...

    def all_reduce(
        self, tensor: torch.Tensor, op: Any = ..., group: Any = None, async_op: bool = False
    ) -> Any: ...

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = ...,
        group: Any = None,
        async_op: bool = False,
    ) -> Any: ...

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any: ...

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any: ...

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any: ...

    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int: ...

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any: ...

    def irecv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any: ...

    def batch_isend_irecv(self, p2p_op_list: list[Any]) -> list[Any]: ...

    def barrier(self, group: Any = None) -> None: ...
