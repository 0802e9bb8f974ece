"""Collectives over ``torch.distributed``, validated, logged and patched for backend gaps.

[Note: backend workarounds]
Measured with torch 2.13 on gloo, two processes on one host (each case below was run and its
result or error checked):

* ``reduce_scatter_tensor``/``all_gather_into_tensor`` are deprecated in favour of
  ``reduce_scatter_single``/``all_gather_single`` (FutureWarning): the new names are used
  when present. gloo accepts only flat ``(world*n,)`` outputs, so tensors are passed as flat
  views (a stacked ``(world, n)`` output works here too).
* ``ReduceOp.AVG`` fails for integer dtypes and is not available on every backend: unless the
  backend is nccl and the dtype floating point, AVG is done as SUM and a division by the group
  size (integers: truncating division, like C).
* SUM over ``bool`` tensors silently corrupts them: bool tensors are reduced as uint8 with the
  logical equivalent (SUM/MAX/BOR -> MAX (or), MIN/PRODUCT/BAND -> MIN (and), BXOR -> BXOR) and
  copied back.
* ``all_gather`` with tensors of different sizes is unsupported: each input is padded to the
  largest size, gathered flat and trimmed back.
* gloo's ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are slower than exchanging
  the same bytes point to point: on gloo they run as direct exchanges, see
  [Note: gloo direct collectives] in ``gloo_direct.py``.

Post-processing runs when the op completes: immediately for synchronous calls, on the first
``wait()`` of the returned ``zero_core.comm.Work`` for ``async_op=True``.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from zero_core.comm import gloo_direct
from zero_core.comm._issue import check_tensor, issue, nbytes
from zero_core.comm.all_to_all import NO_ALL_TO_ALL, all_to_all_p2p, unsupported
from zero_core.comm.groups import (
    check_group,
    check_member_rank,
    is_non_member,
    require_initialized,
    to_timedelta,
)
from zero_core.comm.work import Work
from zero_core.utils.tensor_alias import apart_or_slot

ReduceOp = dist.ReduceOp
# What ``op`` arguments take: a member such as ``ReduceOp.SUM`` (a RedOpType) or a ReduceOp.
_Op = ReduceOp | ReduceOp.RedOpType

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_BOOL_OPS = {
    ReduceOp.SUM: ReduceOp.MAX,
    ReduceOp.MAX: ReduceOp.MAX,
    ReduceOp.BOR: ReduceOp.MAX,
    ReduceOp.MIN: ReduceOp.MIN,
    ReduceOp.PRODUCT: ReduceOp.MIN,
    ReduceOp.BAND: ReduceOp.MIN,
    ReduceOp.BXOR: ReduceOp.BXOR,
}


def _prepare(where: str, group: dist.ProcessGroup | None) -> int:
    require_initialized(where)
    check_group(group, where)
    if is_non_member(group) or dist.get_rank(group) < 0:
        raise ValueError(
            f"zero_core.comm.{where}: this rank ({dist.get_rank()}) is not a member of the given group"
        )
    return dist.get_world_size(group)


def _check_op(op: object, where: str) -> None:
    if not isinstance(op, (ReduceOp, ReduceOp.RedOpType)):
        raise TypeError(f"zero_core.comm.{where}: op must be a zero_core.comm.ReduceOp, got {op!r}")


def _check_same(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(
            f"zero_core.comm.{where}: output and input must share dtype and device, got "
            f"{a.dtype}/{a.device} and {b.dtype}/{b.device}"
        )


def _check_output_input(output: torch.Tensor, input: torch.Tensor, where: str) -> None:
    """Both are tensors of one dtype and device."""
    check_tensor(output, "output", where)
    check_tensor(input, "input", where)
    _check_same(output, input, where)


def _check_world_multiple(
    big: torch.Tensor, small: torch.Tensor, n: int, names: tuple[str, str], where: str
) -> None:
    """``big`` (named ``names[0]``) holds exactly world_size ``n`` times ``small``'s elements."""
    if big.numel() != small.numel() * n:
        raise ValueError(
            f"zero_core.comm.{where}: {names[0]} must have world_size ({n}) x {names[1]}.numel() "
            f"= {small.numel() * n} elements, got {big.numel()}"
        )


def _avg_is_native(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    return tensor.is_floating_point() and dist.get_backend(group) == "nccl"


def _divide(tensor: torch.Tensor, n: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(n)
    else:
        tensor.copy_(torch.div(tensor, n, rounding_mode="trunc"))


class _Reduction:
    """How to run a reduction on ``tensor``: the buffer and op to hand to torch, and the fix-up."""

    def __init__(
        self, tensor: torch.Tensor, op: _Op, group: dist.ProcessGroup | None, n: int, where: str
    ) -> None:
        _check_op(op, where)
        self.op, self.buffer, self.divide = op, tensor, False
        if tensor.dtype == torch.bool:
            if op not in _BOOL_OPS:
                raise ValueError(f"zero_core.comm.{where}: {op} is not defined for bool tensors")
            self.op, self.buffer = _BOOL_OPS[op], tensor.to(torch.uint8)
        elif op == ReduceOp.AVG and not _avg_is_native(tensor, group):
            self.op, self.divide = ReduceOp.SUM, True
        self.tensor, self.n = tensor, n

    def finalize(self, result: torch.Tensor | None = None) -> None:
        result = self.buffer if result is None else result
        if self.divide:
            _divide(result, self.n)
        same = result.dtype == self.tensor.dtype and result.data_ptr() == self.tensor.data_ptr()
        if not same:
            self.tensor.copy_(result.view(self.tensor.shape).to(self.tensor.dtype))


def all_reduce(
    tensor: torch.Tensor,
    op: _Op = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` across ``group`` in place on every rank."""
    n = _prepare("all_reduce", group)
    check_tensor(tensor, "tensor", "all_reduce")
    red = _Reduction(tensor, op, group, n, "all_reduce")
    return issue(
        "all_reduce",
        group,
        nbytes(tensor),
        tensor.device,
        lambda a: dist.all_reduce(red.buffer, op=red.op, group=group, async_op=a),
        async_op=async_op,
        finalize=red.finalize,
    )


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: _Op = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` into global rank ``dst`` (other ranks' tensors are left unspecified)."""
    n = _prepare("reduce", group)
    check_tensor(tensor, "tensor", "reduce")
    check_member_rank(dst, group, "dst", "reduce")
    red = _Reduction(tensor, op, group, n, "reduce")
    is_dst = dist.get_rank() == dst

    def finalize() -> None:
        if is_dst:
            red.finalize()

    return issue(
        "reduce",
        group,
        nbytes(tensor),
        tensor.device,
        lambda a: dist.reduce(red.buffer, dst, op=red.op, group=group, async_op=a),
        async_op=async_op,
        finalize=finalize,
        where={"root": dst},
    )


def _flat_out(output: torch.Tensor) -> torch.Tensor:
    """A flat view of ``output`` when possible, else a flat scratch buffer to copy back from."""
    if output.is_contiguous() and output.dtype != torch.bool:
        return output.view(-1)
    return torch.empty(
        output.numel(),
        dtype=torch.uint8 if output.dtype == torch.bool else output.dtype,
        device=output.device,
    )


def _direct(
    group: dist.ProcessGroup | None, full: torch.Tensor, piece: torch.Tensor, *, reduce: bool
) -> bool:
    """Whether to run the op as a direct exchange: gloo, and the two buffers apart or in place
    (a partial overlap keeps torch's collective). See [Note: gloo direct collectives]."""
    return gloo_direct.applies(group, piece, reduce) and apart_or_slot(full, piece, dist.get_rank(group))


def _run(work: gloo_direct.DirectWork, async_op: bool) -> gloo_direct.DirectWork | None:
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: _Op = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input`` (world_size equal chunks, flat order) and give rank i chunk i in ``output``."""
    n = _prepare("reduce_scatter_tensor", group)
    _check_output_input(output, input, "reduce_scatter_tensor")
    _check_world_multiple(input, output, n, ("input", "output"), "reduce_scatter_tensor")
    red = _Reduction(output, op, group, n, "reduce_scatter_tensor")
    flat_out = _flat_out(output)
    flat_in = input.reshape(-1).to(flat_out.dtype)
    if red.op == ReduceOp.SUM and _direct(group, flat_in, flat_out, reduce=True):
        call = lambda a: _run(gloo_direct.reduce_scatter(flat_out, flat_in, group), a)  # noqa: E731
    else:
        call = lambda a: _reduce_scatter(flat_out, flat_in, op=red.op, group=group, async_op=a)  # noqa: E731
    return issue(
        "reduce_scatter_tensor",
        group,
        nbytes(input),
        input.device,
        call,
        async_op=async_op,
        finalize=lambda: red.finalize(flat_out),
    )


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Concatenate every rank's ``input`` (flat, in group-rank order) into ``output``."""
    n = _prepare("all_gather_into_tensor", group)
    _check_output_input(output, input, "all_gather_into_tensor")
    _check_world_multiple(output, input, n, ("output", "input"), "all_gather_into_tensor")
    flat_out = _flat_out(output)
    flat_in = input.reshape(-1).to(flat_out.dtype)

    def finalize() -> None:
        if flat_out.data_ptr() != output.data_ptr() or output.dtype == torch.bool:
            output.copy_(flat_out.view(output.shape).to(output.dtype))

    if _direct(group, flat_out, flat_in, reduce=False):
        call = lambda a: _run(gloo_direct.all_gather(flat_out, flat_in, group), a)  # noqa: E731
    else:
        call = lambda a: _all_gather(flat_out, flat_in, group=group, async_op=a)  # noqa: E731
    return issue(
        "all_gather_into_tensor",
        group,
        nbytes(output),
        output.device,
        call,
        async_op=async_op,
        finalize=finalize,
    )


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]``; sizes may differ per rank."""
    n = _prepare("all_gather", group)
    check_tensor(tensor, "tensor", "all_gather")
    if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != n:
        raise ValueError(f"zero_core.comm.all_gather: tensor_list must be a list of world_size ({n}) tensors")
    for i, t in enumerate(tensor_list):
        check_tensor(t, f"tensor_list[{i}]", "all_gather")
        _check_same(t, tensor, "all_gather")
    me = dist.get_rank(group)
    if tensor_list[me].numel() != tensor.numel():
        raise ValueError(
            f"zero_core.comm.all_gather: tensor_list[{me}] (this rank) has {tensor_list[me].numel()} "
            f"elements but tensor has {tensor.numel()}"
        )
    size = sum(nbytes(t) for t in tensor_list)
    if all(t.shape == tensor.shape for t in tensor_list) and tensor.dtype != torch.bool:
        return issue(
            "all_gather",
            group,
            size,
            tensor.device,
            lambda a: dist.all_gather(list(tensor_list), tensor, group=group, async_op=a),
            async_op=async_op,
        )
    # Uneven sizes (or bool): pad to the largest, gather flat, trim. See [Note: backend workarounds].
    width = max(t.numel() for t in tensor_list)
    dtype = torch.uint8 if tensor.dtype == torch.bool else tensor.dtype
    padded = torch.zeros(width, dtype=dtype, device=tensor.device)
    padded[: tensor.numel()].copy_(tensor.reshape(-1).to(dtype))
    gathered = torch.empty(width * n, dtype=dtype, device=tensor.device)

    def finalize() -> None:
        for i, t in enumerate(tensor_list):
            t.copy_(gathered[i * width : i * width + t.numel()].view(t.shape).to(t.dtype))

    return issue(
        "all_gather",
        group,
        size,
        tensor.device,
        lambda a: _all_gather(gathered, padded, group=group, async_op=a),
        async_op=async_op,
        finalize=finalize,
    )


def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Copy ``tensor`` of global rank ``src`` into ``tensor`` on every member of ``group``."""
    _prepare("broadcast", group)
    check_tensor(tensor, "tensor", "broadcast")
    check_member_rank(src, group, "src", "broadcast")
    return issue(
        "broadcast",
        group,
        nbytes(tensor),
        tensor.device,
        lambda a: dist.broadcast(tensor, src, group=group, async_op=a),
        async_op=async_op,
        where={"root": src},
    )


def _check_splits(splits: list[int] | None, dim0: int, n: int, name: str) -> None:
    where = "zero_core.comm.all_to_all_single"
    if splits is None:
        if dim0 % n:
            raise ValueError(f"{where}: without {name}, dim 0 ({dim0}) must be divisible by world_size ({n})")
        return
    splits = list(splits)
    if len(splits) != n or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in splits):
        raise ValueError(f"{where}: {name} must be {n} non-negative ints, got {splits}")
    if sum(splits) != dim0:
        raise ValueError(f"{where}: {name} sums to {sum(splits)} but dim 0 of the tensor is {dim0}")


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0, send chunk i to rank i, concatenate what arrives in ``output``.

    Split sizes may be uneven (the MoE dispatch case); None means equal chunks. A backend
    without the op gets a point-to-point exchange: See [Note: all-to-all fallback].
    """
    n = _prepare("all_to_all_single", group)
    _check_output_input(output, input, "all_to_all_single")
    if output.dim() == 0 or input.dim() == 0:
        raise ValueError("zero_core.comm.all_to_all_single: tensors must have at least one dimension")
    _check_splits(output_split_sizes, output.shape[0], n, "output_split_sizes")
    _check_splits(input_split_sizes, input.shape[0], n, "input_split_sizes")
    backend = str(dist.get_backend(group))
    if not async_op and backend in NO_ALL_TO_ALL:  # See [Note: all-to-all fallback]
        return all_to_all_p2p(output, input, output_split_sizes, input_split_sizes, group)
    try:
        return issue(
            "all_to_all_single",
            group,
            nbytes(input),
            input.device,
            lambda a: dist.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=group, async_op=a
            ),
            async_op=async_op,
            where={"send_splits": _split_bytes(input, input_split_sizes, n)},
        )
    except RuntimeError as exc:
        if async_op or not unsupported(exc):
            raise
        NO_ALL_TO_ALL.add(backend)
        return all_to_all_p2p(output, input, output_split_sizes, input_split_sizes, group)


def _split_bytes(input: torch.Tensor, splits: list[int] | None, n: int) -> list[int]:
    """Bytes sent to each member by ``all_to_all_single`` (for [Note: bytes by link class])."""
    row = nbytes(input) // max(input.shape[0], 1)
    rows = list(splits) if splits is not None else [input.shape[0] // n] * n
    return [r * row for r in rows]


def broadcast_object_list(
    object_list: list[object],
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Replace ``object_list``'s items on every rank with those of global rank ``src`` (pickled)."""
    _prepare("broadcast_object_list", group)
    if not isinstance(object_list, list):
        raise TypeError(
            f"zero_core.comm.broadcast_object_list: object_list must be a list, got {type(object_list).__name__}"
        )
    check_member_rank(src, group, "src", "broadcast_object_list")
    issue(
        "broadcast_object_list",
        group,
        0,
        None,
        lambda _a: dist.broadcast_object_list(object_list, src, group=group, device=device),
        async_op=False,
        waitable=False,
    )


def all_gather_object(object_list: list[object], obj: object, group: dist.ProcessGroup | None = None) -> None:
    """Fill ``object_list[i]`` with rank i's ``obj`` (pickled; ``object_list`` has world_size slots)."""
    n = _prepare("all_gather_object", group)
    if not isinstance(object_list, list) or len(object_list) != n:
        raise ValueError(
            f"zero_core.comm.all_gather_object: object_list must be a list of world_size ({n}) slots"
        )
    issue(
        "all_gather_object",
        group,
        0,
        None,
        lambda _a: dist.all_gather_object(object_list, obj, group=group),
        async_op=False,
        waitable=False,
    )


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Block until every member of ``group`` reaches the barrier."""
    _prepare("barrier", group)
    issue("barrier", group, 0, None, lambda a: dist.barrier(group=group, async_op=a), async_op=False)


def monitored_barrier(
    group: dist.ProcessGroup | None = None,
    timeout: timedelta | float | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """A barrier that raises, naming the missing rank(s), after ``timeout`` (seconds or timedelta).

    Supported by gloo only (torch's limitation).
    """
    _prepare("monitored_barrier", group)
    td = to_timedelta(timeout, "monitored_barrier")
    issue(
        "monitored_barrier",
        group,
        0,
        None,
        lambda _a: dist.monitored_barrier(group=group, timeout=td, wait_all_ranks=wait_all_ranks),
        async_op=False,
        waitable=False,
    )
