"""Per-parameter partition state of ZeRO stage 3: the local 1/N shard, gather and release.

[Note: stage 3 parameter layout]
A partitioned parameter ``p`` keeps its ``torch.nn.Parameter`` identity (optimizers, hooks
and user references stay valid) and has a :class:`PartitionState` record, owned by the strategy
or ``zero.Init`` that partitioned it and reached as ``partition_state(p)`` (See [Note: stage 3
parameter records]).
The parameter's values, flattened and zero-padded to a multiple of the group size N, are
cut into N equal chunks; rank r keeps chunk r in the record's ``shard``. For users the
parameter shows it as ``p.zero_shard`` (our name for DeepSpeed's ``param.ds_tensor``;
``p.zero_numel`` / ``p.zero_shape`` are ``ds_numel`` / ``ds_shape``): public, read-only
names kept in step with the record, which internal code never reads.

While released, ``p.data`` is an empty tensor: reading it outside a gather gives a
shape-mismatch error, never stale or garbage values. While gathered, ``p.data`` is a view of
``state.full``, a padded flat buffer of the whole parameter. Releasing resizes that buffer's
*storage* to zero bytes (instead of dropping the tensor), which matters because autograd may
have saved views of the weight (``weight.t()`` inside ``F.linear``): those views share the
storage, so releasing really frees the memory, and re-gathering into the same storage makes
the saved views valid again for backward. Autograd never reads them while released because
every module's backward is preceded by a gather (see [Note: stage 3 hooks]).

[Note: tensors taken from a gathered parameter]
User code can take tensors from a gathered parameter that outlive the gather: inside
``GatheredParameters`` it may keep ``p.detach()``, ``p.data``, a view or a slice. Such a tensor
shares the gather buffer's storage, and resizing that storage to zero bytes would leave it
pointing at freed memory: reading it then crashes the process (a segmentation fault in
``sum``/``print``, garbage through ``numpy()``), which user code must never reach. So every
release except the one after a module's forward asks whether anything besides the buffer
itself still uses the storage (the storage's use count, :func:`_has_outside_references`);
if so, the parameter gets a *fresh* unallocated gather buffer and the old storage is left to
its holders, who keep valid values of the parameter as of the release, and the memory is
freed by reference counting when the last of them goes. With no outside holder the storage is
resized to zero as before, so the common case allocates nothing new. (FSDP2 frees its
unsharded parameters by resizing storage too and does not protect such tensors.)

The release after a module's forward is the exception: there the outside holders are
autograd's saved views (``weight.t()``), which rely on the in-place re-gather described above,
and keeping that storage alive until backward would hold every layer's full weights at once.
So a tensor taken from a parameter *inside a module's forward while ZeRO-3 hooks gather it*
(not inside ``GatheredParameters``) is only valid until that module's forward returns, as
with FSDP; copy it (``.clone()``) to keep it. A release during backward keeps views valid:
autograd frees a node's saved views as soon as the node has run, so the storage is normally
unshared by then; with ``retain_graph=True`` the retained graph keeps its own copy alive until
it is freed.

The agreement check before each collective: See [Note: stage 3 collective agreement] in
``collective_agreement.py``.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zero_core import comm
from zero_core.comm import watchdog as _watchdog
from zero_core.protocols.shard_store import PLAIN_SHARDS, ShardStore
from zero_core.zero.stage3.allreduce_fetch import all_reduce_fetch, fetch_by_all_reduce
from zero_core.zero.stage3.collective_agreement import (  # noqa: F401 (re-exported: the public names)
    Stage3CollectiveError,
    check_agreement,
    collective_checks,
    set_collective_checks,
    wait_bounded,
)
from zero_core.zero.stage3.param_records import RecordOwner, attach_record, is_partitioned
from zero_core.zero.stage3.runtime_context import stage3_context
from zero_core.zero.stage3.shard_groups import (
    ShardRoute,
    broadcast_group,
    gather_source,
    keep_secondary,
    source_key,
)
from zero_core.zero.stage3.streams import stage3_streams

_ALIGN = 16  # bytes; every shard starts at an address aligned for any dtype view


class ParamStatus(enum.Enum):
    NOT_AVAILABLE = 0
    INFLIGHT = 1
    AVAILABLE = 2


def set_collective_timeout(seconds: float) -> None:
    """Bound every collective wait to ``seconds``: the collective watchdog's timeout (see
    [Note: collective watchdog] in ``zero_core.comm.watchdog``), which stage 3 shares."""
    _watchdog.set_collective_timeout(seconds)


def collective_timeout() -> float:
    return _watchdog.collective_timeout()


def set_param_name(param: torch.nn.Parameter, name: str) -> None:
    """Record a readable name for error messages in ``param``'s record (the strategy uses
    qualified module names)."""
    param._zero_record.name = name


def param_name(param: torch.nn.Parameter) -> str:
    """``param``'s readable name: the one its record was given, else ``param#<id>``."""
    st = param._zero_record
    return st.name if st.name is not None else f"param#{st.id}"


class PartitionState:
    """What a rank knows about one partitioned parameter (see [Note: stage 3 parameter layout])."""

    __slots__ = (
        "id",
        "shape",
        "numel",
        "padded_numel",
        "shard_numel",
        "group",
        "world",
        "rank",
        "shard",
        "full",
        "status",
        "persistent",
        "grad_shard",
        "holds",
        "active",
        "empty",
        "store",
        "grad_divisor",
        "route",
        "secondary",
        "owner",
        "name",
        "__weakref__",  # tests check that a dropped engine leaves no record behind
    )

    def __init__(self, param: torch.nn.Parameter, group: Any, grad_divisor: int | None = None) -> None:
        self.id = stage3_context().next_param_id()
        self.group = group
        self.world = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.shape = param.shape
        self.numel = param.numel()
        self.shard_numel = -(-self.numel // self.world)
        self.padded_numel = self.shard_numel * self.world
        self.shard: torch.Tensor = torch.empty(0)
        self.full: torch.Tensor = torch.empty(0)
        self.status = ParamStatus.NOT_AVAILABLE
        self.persistent = False
        self.grad_shard: torch.Tensor | None = None
        self.holds = 0  # GatheredParameters / construction-time holders
        self.active = 0  # modules currently running that use it
        self.empty = torch.empty(0, dtype=param.dtype, device=param.device)
        # where the shard lives between gathers: See [Note: shard store seam]
        self.store: ShardStore = PLAIN_SHARDS
        # The summed gradient is divided by this: the group size, or for an expert parameter the
        # whole data-parallel world size (see [Note: stage 3 expert parameters]).
        self.grad_divisor = self.world if grad_divisor is None else grad_divisor
        # MiCS/hpZ groups and the hpZ secondary copy: See [Note: MiCS and hpZ shard groups]
        self.route: Any = None
        self.secondary: torch.Tensor | None = None
        # weak reference to its owner: the zero.Init that partitioned it until an engine takes it,
        # then the strategy training it (cleared by its close()); weak so that a record never
        # keeps a model alive (See [Note: stage 3 parameter records])
        self.owner: weakref.ref | None = None
        self.name: str | None = None  # readable name for error messages (set_param_name)

    def owner_of(self) -> RecordOwner | None:
        """The record's owner (a ``Stage3Strategy`` or ``zero.Init``; None: no live owner)."""
        return None if self.owner is None else self.owner()

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        # process state (groups, buffers): a pickled parameter comes back unpartitioned, as a
        # parameter without a record (See [Note: stage 3 parameter records])
        return _no_record, ()


def _no_record() -> None:
    return None


def _full_view(st: PartitionState) -> torch.Tensor:
    return st.full[: st.numel].view(st.shape)


def partition_param(
    param: torch.nn.Parameter,
    group: Any = None,
    *,
    broadcast_from: int | None = 0,
    grad_divisor: int | None = None,
) -> None:
    """Turn a full parameter into its 1/N shard over ``group``, in place.

    Values are broadcast from group rank ``broadcast_from`` (None: keep each rank's own).
    ``grad_divisor`` is what the gradient summed over ``group`` is divided by (default: the
    group size; see [Note: stage 3 expert parameters] for why experts differ).
    """
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"partition_param: expected a torch.nn.Parameter, got {type(param).__name__}")
    if grad_divisor is not None and (
        isinstance(grad_divisor, bool) or not isinstance(grad_divisor, int) or grad_divisor < 1
    ):
        raise ValueError(f"partition_param: grad_divisor must be an int >= 1 or None, got {grad_divisor!r}")
    if is_partitioned(param):
        return
    st = PartitionState(param, group, grad_divisor)
    data = param.data
    if broadcast_from is not None and st.world > 1:
        data = data.contiguous()
        comm.broadcast(
            data,
            src=comm.get_global_rank(group, broadcast_from) if group is not None else broadcast_from,
            group=group,
        )
    flat = data.reshape(-1)
    lo = st.rank * st.shard_numel
    hi = min(lo + st.shard_numel, st.numel)
    shard = torch.zeros(st.shard_numel, dtype=data.dtype, device=data.device)
    if hi > lo:
        shard[: hi - lo].copy_(flat[lo:hi])
    st.shard = shard
    st.full = torch.empty(st.padded_numel, dtype=data.dtype, device=data.device)
    st.full.untyped_storage().resize_(0)
    attach_record(param, st)  # See [Note: stage 3 parameter records]
    param.zero_shard = shard
    param.zero_numel = st.numel
    param.zero_shape = st.shape
    param.data = st.empty


@torch.no_grad()
def partition_on_route(param: torch.nn.Parameter, route: ShardRoute) -> None:
    """Partition ``param`` for ``route``'s MiCS or hpZ layout, rank 0's values everywhere (see
    [Note: MiCS and hpZ shard groups]); a parameter already partitioned is left as it is."""
    if is_partitioned(param):
        return
    if route.mics:
        if route.world > 1:  # replicas must agree: rank 0 of the world, not of each shard group
            data = param.data.contiguous()
            comm.broadcast(data, src=0)
            param.data = data
        partition_param(param, route.shard_group, broadcast_from=None, grad_divisor=route.world)
    else:
        partition_param(param, None, broadcast_from=0)
    param._zero_record.route = route


def set_shard_dtype(param: torch.nn.Parameter, dtype: torch.dtype) -> None:
    """Cast a released partitioned parameter's storage (shard, gather buffer) to ``dtype``."""
    st = param._zero_record
    st.secondary = None
    if st.shard.dtype == dtype:
        return
    if st.status is not ParamStatus.NOT_AVAILABLE:
        release_param(param, force=True)
    # the store hands the shard back as a plain tensor, or re-homes it at once in ``dtype``
    # (zero-offload's ParamOffload): See [Note: shard store seam]
    st.store.set_dtype(param, dtype)
    st.shard = st.shard.to(dtype)
    param.zero_shard = st.shard
    st.full = torch.empty(st.padded_numel, dtype=dtype, device=st.shard.device)
    st.full.untyped_storage().resize_(0)
    st.empty = torch.empty(0, dtype=dtype, device=st.shard.device)
    param.data = st.empty


def read_shard(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's shard values, wherever they live (see [Note: offloaded shards]).

    [Note: offloaded shards]
    With a transient shard store (zero-offload's ``ParamOffload`` for
    ``zero_optimization.offload_param``, the quantized store of frozen weights) ``st.shard``'s
    storage is empty except while it is packed for an all-gather: ``gather_params`` asks
    ``st.store.fetch`` for it just before and ``st.store.release`` drops it right after.
    Every other read or write of shard values goes through :func:`read_shard` /
    :func:`write_shard`, which ask the record's store (the plain store: ``st.shard`` itself).
    See [Note: shard store seam].
    """
    st = param._zero_record
    return st.store.read(st).to(st.shard.device)


def shares_shard(master: torch.Tensor, st: PartitionState) -> bool:
    """Whether ``master`` is the shard itself (fp32 without offload), not a separate copy.

    Compares storages that hold memory: an offloaded shard and a master on NVMe both have
    empty storages (null data pointers) while being different tensors.
    """
    return master.untyped_storage().nbytes() > 0 and master.data_ptr() == st.shard.data_ptr()


@torch.no_grad()
def write_shard(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """Set this rank's shard to ``values`` (flat, cast to the shard dtype), wherever it lives."""
    st = param._zero_record
    st.secondary = None  # stale: See [Note: MiCS and hpZ shard groups]
    st.store.write(st, values)  # See [Note: shard store seam]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class GatherHandle:
    """An in-flight all-gather of a bucket of parameters; :meth:`wait` makes them available."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        work: Any,
        recv: torch.Tensor | None,
        offsets: list[int],
        chunk: int,
        what: str,
        source: Any = None,
        unpack: Any = None,
        states: list[PartitionState] | None = None,
        moved: list[PartitionState] | None = None,
    ) -> None:
        self.params = params
        # shards of transient stores fetched for a gather without a collective (world 1)
        self._moved = moved or []
        # the parameters' records, taken once per bucket (See [Note: stage 3 parameter records])
        self.states = states if states is not None else [p._zero_record for p in params]
        self._source = source
        self._work = work
        self._recv = recv
        # qwZ: ``unpack(i, full)`` dequantizes param i (See [Note: quantized weight all-gather (qwZ)])
        self._unpack = unpack
        self._offsets = offsets
        self._chunk = chunk
        self._what = what
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        if self._work is not None:  # See [Note: stage-3 streams]
            results = [self._recv] if self._recv is not None else list(getattr(self._unpack, "buffers", ()))
            stage3_streams().all_gather_wait(lambda: wait_bounded(self._work, self._what), results)
        for i, (p, st, off) in enumerate(zip(self.params, self.states, self._offsets)):
            st.full.untyped_storage().resize_(st.padded_numel * st.full.element_size())
            if self._unpack is not None:
                self._unpack(i, st.full)
            elif self._recv is None:
                st.full.copy_(st.shard)
            else:
                # One strided copy: column block ``off`` of every rank's chunk -> row r of full.
                world = self._source.world
                nb = st.padded_numel // world * st.full.element_size()
                src = self._recv.view(world, self._chunk)[:, off : off + nb]
                st.full.view(torch.uint8).view(world, nb).copy_(src)
            if self._source is None or not self._source.secondary:
                keep_secondary(st)  # See [Note: MiCS and hpZ shard groups]
            p.data = _full_view(st)
            st.status = ParamStatus.AVAILABLE
        for st in self._moved:  # copied into the gather buffers: See [Note: offloaded shards]
            st.store.release(st)
        self._recv = self._unpack = None


class GroupedGatherHandle:
    """Several :class:`GatherHandle` (one per process group) waited for as one."""

    def __init__(self, handles: list[GatherHandle]) -> None:
        self.handles = handles
        self.params = [p for h in handles for p in h.params]
        self.states = [st for h in handles for st in h.states]

    @property
    def done(self) -> bool:
        return all(h.done for h in self.handles)

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


def gather_params(
    params: Iterable[torch.nn.Parameter], what: str = "", quantize: Any = None
) -> GatherHandle | GroupedGatherHandle | None:
    """Start gathering the released parameters among ``params`` (one collective per group).

    Each parameter is gathered over the group it is partitioned over: one all-gather for the
    bucket, or one per group when it mixes dense and expert parameters (launched in order of
    first appearance; see [Note: stage 3 expert parameters]). ``quantize(p)`` (ZeRO++ qwZ, None:
    never) says which parameters travel int8-quantized (True, or ``"aligned"`` for shards stored
    quantized); those get a collective of their own.
    All ranks must call this with the same parameters in the same order. Returns None when
    nothing needed gathering.
    """
    # each parameter's record is looked up once per bucket: See [Note: stage 3 parameter records]
    todo, states = [], []
    for p in params:
        st = p._zero_record
        if st.status is ParamStatus.NOT_AVAILABLE:
            todo.append(p)
            states.append(st)
    if not todo:
        return None
    by_group: dict[tuple[Any, ...], tuple[list[torch.nn.Parameter], list[PartitionState]]] = {}
    all_reduce = fetch_by_all_reduce(states[0])  # the owner decides: See [Note: all-reduce fetch]
    # by group, primary/secondary, quantization and (all-reduce fetch) dtype: See [Note: MiCS and
    # hpZ shard groups]
    for p, st in zip(todo, states):
        q = (quantize(p) or False) if quantize is not None else False
        ar = st.shard.dtype if all_reduce and not q and _all_reducible(st) else None
        ps, sts = by_group.setdefault((*source_key(st), q, ar), ([], []))
        ps.append(p)
        sts.append(st)
    if len(by_group) == 1:
        ((*_, q, ar),) = by_group
        return _gather_group(todo, states, what, q, ar is not None)
    return GroupedGatherHandle(
        [_gather_group(ps, sts, what, key[-2], key[-1] is not None) for key, (ps, sts) in by_group.items()]
    )


def _all_reducible(st: PartitionState) -> bool:
    """A fetch of the primary shards over one flat group (See [Note: all-reduce fetch])."""
    source = gather_source(st)
    return not source.secondary and (source.route is None or source.route.hops is None)


def _packed(p: torch.nn.Parameter, st: PartitionState) -> None:
    """``all_reduce_fetch``'s per-parameter callback: the moved shards are released after it."""


def _all_reduce_group(
    todo: list[torch.nn.Parameter],
    states: list[PartitionState],
    source: Any,
    label: str,
    moved: list[PartitionState],
) -> GatherHandle:
    """The bucket fetched by one all-reduce of a zero-padded buffer (See [Note: all-reduce fetch])."""
    label = label.replace("all-gather of", "all-reduce fetch of", 1)
    nbytes = sum(st.padded_numel for st in states) * states[0].shard.element_size()
    check_agreement(3, todo, nbytes, source.group, label)
    crossing = [st.shard for st in moved]  # See [Note: stage-3 streams]
    with stage3_streams().all_gather_issue(crossing):
        work, unpack, _ = all_reduce_fetch(todo, states, source.group, _packed)
        for st in moved:  # packed into the buffer: See [Note: offloaded shards]
            st.store.release(st)
    return GatherHandle(todo, work, None, [0] * len(todo), 0, label, source, unpack=unpack, states=states)


def _gather_group(
    todo: list[torch.nn.Parameter],
    states: list[PartitionState],
    what: str,
    quantized: Any = False,
    all_reduce: bool = False,
) -> GatherHandle:
    label = f"all-gather of {[param_name(p) for p in todo[:4]]}" + (f" ({what})" if what else "")
    source = gather_source(states[0])  # See [Note: MiCS and hpZ shard groups]
    world = source.world
    offsets, chunk = [], 0
    for st in states:
        offsets.append(chunk)
        chunk += _aligned(source.piece(st).numel() * st.shard.element_size())
    fetch = not source.secondary
    for st in states:
        st.status = ParamStatus.INFLIGHT
    # Only the transient stores' shards are fetched and released around the packing (See [Note:
    # offloaded shards]); a bucket of plain shards costs one filter, as the old branches did.
    moved = [st for st in states if st.store.transient] if fetch else []
    by_store: dict[int, tuple[Any, list[PartitionState]]] = {}
    for st in moved:
        by_store.setdefault(id(st.store), (st.store, []))[1].append(st)
    for store, bucket in by_store.values():
        store.fetch_bucket(bucket)  # reads started together: See [Note: read-ahead] in zero-offload
    if world == 1:
        return GatherHandle(todo, None, None, offsets, chunk, label, source, states=states, moved=moved)
    if all_reduce:
        return _all_reduce_group(todo, states, source, label, moved)
    check_agreement(0, todo, chunk, source.group, label)
    device = states[0].shard.device
    # read on the all-gather stream, possibly freed soon after: See [Note: stage-3 streams]
    crossing = [source.piece(st) for st in states] if source.secondary else [st.shard for st in moved]
    with stage3_streams().all_gather_issue(crossing):
        if quantized and fetch:  # ZeRO++ qwZ: See [Note: quantized weight all-gather (qwZ)]
            from zero_core.comm.quantized_collectives import quantized_all_gather

            # From the primary shards over the source's group (MiCS: the shard group, flat even
            # when the plain gather would take two hops); hpZ's secondary gathers stay inside the
            # node in 16 bits, as they are not the cross-node traffic qwZ exists to halve.
            shards = [st.shard for st in states]
            work, unpack = quantized_all_gather(shards, source.group, aligned=quantized == "aligned")
            for st in moved:
                st.store.release(st)
            return GatherHandle(
                todo, work, None, offsets, chunk, label + " (int8)", source, unpack=unpack, states=states
            )
        send = torch.empty(chunk, dtype=torch.uint8, device=device)
        for st, off in zip(states, offsets):
            sh = source.piece(st)
            send[off : off + sh.numel() * sh.element_size()].copy_(sh.view(torch.uint8))
        for st in moved:  # packed: See [Note: offloaded shards]
            st.store.release(st)
        recv = torch.empty(chunk * world, dtype=torch.uint8, device=device)
        work = source.all_gather(recv, send)
    return GatherHandle(todo, work, recv, offsets, chunk, label, source, states=states)


def release_param(param: torch.nn.Parameter, force: bool = False, keep_outside_views: bool = True) -> bool:
    """Free the gathered copy of ``param`` (kept if persistent or held, unless ``force``).

    ``keep_outside_views=False`` is for the release after a module's forward only: there the
    references to the gathered buffer are autograd's saved views, which must see the buffer
    re-gathered in place for backward. See [Note: tensors taken from a gathered parameter].
    """
    st = param._zero_record
    if st.status is not ParamStatus.AVAILABLE:
        return False
    if not force and (st.persistent or st.holds > 0):
        return False
    param.data = st.empty
    if keep_outside_views and _has_outside_references(st.full):
        st.full = _unallocated_full(st)
    else:
        st.full.untyped_storage().resize_(0)
    st.status = ParamStatus.NOT_AVAILABLE
    return True


def _has_outside_references(full: torch.Tensor) -> bool:
    """Whether a tensor other than ``full`` itself uses ``full``'s storage.

    ``_storage_Use_Count`` counts the storage's owners: ``full`` and the temporary Python
    storage object made to ask. Without that (private) counter we assume there are others,
    which is always safe (see [Note: tensors taken from a gathered parameter]).
    """
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return True
    storage = full.untyped_storage()
    return int(count(storage._cdata)) > 2


def _unallocated_full(st: PartitionState) -> torch.Tensor:
    """A fresh gather buffer of the parameter's padded size whose storage holds no memory yet."""
    full = torch.empty(st.padded_numel, dtype=st.full.dtype, device=st.full.device)
    full.untyped_storage().resize_(0)
    return full


@torch.no_grad()
def shard_from_full(param: torch.nn.Parameter) -> None:
    """Copy this rank's chunk of the gathered value back into the shard (after a modification)."""
    st = param._zero_record
    if st.status is not ParamStatus.AVAILABLE:
        raise RuntimeError(f"shard_from_full: {param_name(param)} is not gathered")
    write_shard(param, st.full[st.rank * st.shard_numel : (st.rank + 1) * st.shard_numel])


def broadcast_full(param: torch.nn.Parameter, src: int) -> None:
    """Broadcast a gathered parameter's value from group rank ``src`` (modifier semantics)."""
    st = param._zero_record
    group, world = broadcast_group(st)  # MiCS: over every replica, See [Note: MiCS and hpZ shard groups]
    if world == 1:
        return
    what = f"broadcast of {param_name(param)} from rank {src}"
    check_agreement(2, [param], st.padded_numel * st.full.element_size(), group, what)
    src_global = comm.get_global_rank(group, src) if group is not None else src
    wait_bounded(comm.broadcast(st.full, src=src_global, group=group, async_op=True), what)
