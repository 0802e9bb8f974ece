"""The universal checkpoint representation: fragments of named parameters.

Every strategy describes its state as :class:`Fragment` objects (see [Note: checkpoint
format]): "elements ``[start, end)`` of the flattened ``kind`` value of parameter ``name``,
whose full shape is ``shape``". A data-parallel rank emits whole tensors, a ZeRO-1/2 rank
the segments of each parameter its flat shard covers, a ZeRO-3 rank its parameter shards.
On load a strategy asks the :class:`CheckpointReader` for exactly the ranges it owns now,
and the reader assembles them from whichever rank files hold them. That is what makes a
checkpoint saved with N ranks at stage s load with M ranks at stage s'.

Kinds: ``param`` (the module's weight in its training dtype), ``fp32`` (the fp32 master;
absent when the module weight is itself the fp32 master, the reader then falls back to
``param``), ``optim.<key>`` (optimizer state ``key``), ``buffer`` (module buffers).
``elementwise`` says a value has one element per parameter element (weights, exp_avg) as
opposed to a per-parameter value (Adam's ``step``), which is stored whole.

[Note: deferred fragments]
A fragment normally holds a view of the live state (no copy). Values that live off memory
(parameter shards, masters and optimizer states on NVMe or in an offload's host store, see
[Note: ZeRO-Infinity streaming] in zero-offload) would have to be read into a new tensor, and
reading all of them before writing would hold a rank's whole partition at once. Such a
fragment is *deferred* (:meth:`Fragment.deferred`): its ``tensor`` is a ``meta`` placeholder
with the dtype and element count (what the rank table records), and ``produce()`` reads the
values when the saver writes that tensor, so saving holds one of them at a time. Strategies
describe NVMe-resident optimizer states the same way with :class:`DeferredTensor`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from zero_core.checkpoint.format import CheckpointError, dtype_from_name, dtype_name
from zero_core.checkpoint.integrity import check_file_size, verify_file
from zero_core.checkpoint.single_pass import read_files_once
from zero_core.checkpoint.tensor_file import TensorFile, byte_view

PARAM = "param"
FP32 = "fp32"
BUFFER = "buffer"
OPTIM_PREFIX = "optim."


@dataclass(frozen=True)
class DeferredTensor:
    """A flat value of ``numel`` elements of ``dtype`` read only when written: ``read()`` returns it.

    See [Note: deferred fragments].
    """

    numel: int
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


@dataclass
class Fragment:
    """Elements ``[start, end)`` of the flattened ``kind`` value of parameter ``name``."""

    name: str
    kind: str
    shape: tuple[int, ...]
    start: int
    end: int
    tensor: torch.Tensor
    elementwise: bool = True
    python_scalar: bool = False  # an optimizer state held as a Python number, not a tensor
    # deferred: ``tensor`` is a meta placeholder and this reads the values (See [Note: deferred fragments])
    produce: Callable[[], torch.Tensor] | None = None

    @classmethod
    def deferred(
        cls,
        name: str,
        kind: str,
        shape: tuple[int, ...],
        start: int,
        end: int,
        dtype: torch.dtype,
        produce: Callable[[], torch.Tensor],
    ) -> Fragment:
        """A fragment whose values ``produce()`` reads when it is written (See [Note: deferred fragments])."""
        placeholder = torch.empty(end - start, dtype=dtype, device="meta")
        return cls(name, kind, shape, start, end, placeholder, produce=produce)

    def values(self) -> torch.Tensor:
        """The fragment's values (flat): the held tensor, or a deferred fragment's ``produce()``."""
        if self.produce is None:
            return self.tensor.reshape(-1)
        t = self.produce()
        if t.numel() != self.end - self.start or t.dtype != self.tensor.dtype:
            raise CheckpointError(
                f"fragment {self.kind}:{self.name}: produced {t.numel()} {t.dtype} values for range "
                f"[{self.start}, {self.end}) of {self.tensor.dtype}"
            )
        return t.reshape(-1)

    def __post_init__(self) -> None:
        numel = 1
        for d in self.shape:
            numel *= d
        if not 0 <= self.start <= self.end <= numel:
            raise ValueError(
                f"fragment {self.kind}:{self.name}: range [{self.start}, {self.end}) outside {numel} elements"
            )
        if self.tensor.numel() != self.end - self.start:
            raise ValueError(
                f"fragment {self.kind}:{self.name}: tensor has {self.tensor.numel()} elements for range "
                f"[{self.start}, {self.end})"
            )

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}:{self.start}"

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": dtype_name(self.tensor.dtype),
            "start": self.start,
            "end": self.end,
            "key": self.key,
            "elementwise": self.elementwise,
            "python_scalar": self.python_scalar,
        }


def optimizer_state_fragments(
    name: str,
    shape: tuple[int, ...],
    state: dict[str, Any],
    segments: list[tuple[int, int, int]] | None = None,
    *,
    elementwise_numel: int | None = None,
    emit_scalars: bool = True,
) -> list[Fragment]:
    """Fragments of one parameter's optimizer ``state``.

    ``segments`` (state offset, parameter flat offset, length) maps a flat state tensor of
    ``elementwise_numel`` elements onto the parameter; None means the state tensors have the
    parameter's own shape. Tensors of another size (and Python numbers) are per-parameter
    values, stored whole when ``emit_scalars``. A flat state is 1-D, so a 0-dim tensor (Adam's
    ``step``) is per-parameter even where the shard holds a single element: taken for a range,
    it would be read back as a shard-sized tensor at another world size.
    """
    numel = 1
    for d in shape:
        numel *= d
    per_elem = numel if elementwise_numel is None else elementwise_numel
    out: list[Fragment] = []
    for key, value in state.items():
        kind = OPTIM_PREFIX + key
        if isinstance(value, DeferredTensor) and value.numel == per_elem:
            for so, po, n in segments if segments is not None else [(0, 0, numel)]:
                out.append(
                    Fragment.deferred(name, kind, shape, po, po + n, value.dtype, _slice_of(value, so, n))
                )
        elif (
            torch.is_tensor(value)
            and value.numel() == per_elem
            and (value.dim() == 1 if segments is not None else value.shape == shape)
        ):
            flat = value.detach().reshape(-1)
            for so, po, n in segments if segments is not None else [(0, 0, numel)]:
                out.append(Fragment(name, kind, shape, po, po + n, flat[so : so + n]))
        elif emit_scalars:
            if torch.is_tensor(value):
                t = value.detach()
                out.append(
                    Fragment(name, kind, tuple(t.shape), 0, t.numel(), t.reshape(-1), elementwise=False)
                )
            elif isinstance(value, (bool, int, float)):
                t = torch.tensor([value], dtype=torch.float64 if isinstance(value, float) else torch.int64)
                out.append(Fragment(name, kind, (), 0, 1, t, elementwise=False, python_scalar=True))
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of parameter {name!r} is a {type(value).__name__}; only tensors and "
                    "numbers can be checkpointed"
                )
    return out


def _slice_of(value: DeferredTensor, start: int, n: int) -> Callable[[], torch.Tensor]:
    return lambda: value.read().reshape(-1)[start : start + n]


@runtime_checkable
class CheckpointableStrategy(Protocol):
    """What a :class:`~zero_core.engine.strategy.TrainingStrategy` adds to be checkpointed."""

    def checkpoint_fragments(self, exclude_frozen_parameters: bool = False) -> list[Fragment]:
        """This rank's share of the model, master and optimizer state (collective-free)."""

    def load_checkpoint_fragments(
        self,
        reader: CheckpointReader,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        strict: bool = True,
    ) -> None:
        """Fill this rank's state from ``reader``, whatever world size and stage wrote it."""


@dataclass
class _Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    elementwise: bool
    python_scalar: bool
    pieces: list[tuple[int, int, int, str]] = field(default_factory=list)  # (start, end, rank, key)


class CheckpointReader:
    """Index of every fragment of one checkpoint tag; reads any range of any (name, kind).

    Rank tensor files are opened lazily and their checksum verified the first time they are
    needed, so a rank reads (and verifies) only the files holding ranges it loads. An engine
    load instead reads each file once: whole and checksummed as it goes on the one rank that
    verifies it, only the needed ranges elsewhere (see [Note: single-pass load] in
    ``single_pass.py``): :meth:`begin_single_pass`, the loads, then :meth:`finish_single_pass`.
    """

    def __init__(self, tag_dir: str, rank_tables: list[dict[str, Any]]) -> None:
        self.tag_dir = tag_dir
        self._tables = rank_tables
        self.exclude_frozen = False  # the saver dropped frozen parameters: their absence is not an error
        # DeepSpeed's ``load_from_fp32_weights: false``: fp32 masters are read from the saved module
        # weight (16-bit with fp16/bf16, upcast) rather than the saved fp32 master
        self.masters_from_weights = False
        # {name a strategy asks for: name in the checkpoint}: an expert-parallel rank's local expert
        # names -> global ones (see [Note: expert fragments] in experts.py); applying it is idempotent
        self.aliases: dict[str, str] = {}
        self._files: dict[int, TensorFile] = {}
        self._verified: set[int] = set()  # rank files already checksummed (whole, or by a single pass)
        self._index: dict[tuple[str, str], _Entry] = {}
        # single-pass mode: {rank file touched: [(file offset, destination bytes)]}; None when off
        self._plan: dict[int, list[tuple[int, memoryview]]] | None = None
        self._group: Any = None
        self.touched_state = False  # some tensor data was read or a read into place was planned
        for rank, table in enumerate(rank_tables):
            for rec in table["fragments"]:
                k = (rec["name"], rec["kind"])
                where = f"{tag_dir}/{table['file']}"
                entry = self._index.get(k)
                if entry is None:
                    entry = self._index[k] = _Entry(
                        tuple(rec["shape"]),
                        dtype_from_name(rec["dtype"], where),
                        bool(rec["elementwise"]),
                        bool(rec.get("python_scalar", False)),
                    )
                entry.pieces.append((int(rec["start"]), int(rec["end"]), rank, rec["key"]))
        for entry in self._index.values():
            entry.pieces.sort()

    # -- what is there ------------------------------------------------------------------
    def names(self, kind: str = PARAM) -> list[str]:
        return [n for (n, k) in self._index if k == kind]

    def has(self, name: str, kind: str) -> bool:
        return (self.aliases.get(name, name), kind) in self._index

    def kinds(self, name: str) -> list[str]:
        name = self.aliases.get(name, name)
        return [k for (n, k) in self._index if n == name]

    def optimizer_keys(self, name: str) -> list[str]:
        return [k[len(OPTIM_PREFIX) :] for k in self.kinds(name) if k.startswith(OPTIM_PREFIX)]

    def shape(self, name: str, kind: str) -> tuple[int, ...]:
        return self._entry(name, kind).shape

    def dtype(self, name: str, kind: str) -> torch.dtype:
        return self._entry(name, kind).dtype

    def is_elementwise(self, name: str, kind: str) -> bool:
        return self._entry(name, kind).elementwise

    def is_python_scalar(self, name: str, kind: str) -> bool:
        return self._entry(name, kind).python_scalar

    def _entry(self, name: str, kind: str) -> _Entry:
        name = self.aliases.get(name, name)
        try:
            return self._index[(name, kind)]
        except KeyError:
            raise CheckpointError(
                f"checkpoint {self.tag_dir} holds no {kind!r} value for parameter {name!r}"
            ) from None

    # -- reading ------------------------------------------------------------------------
    def _file(self, rank: int) -> TensorFile:
        f = self._files.get(rank)
        if f is None:
            table = self._tables[rank]
            path = os.path.join(self.tag_dir, table["file"])
            if rank not in self._verified:
                if self._plan is None:
                    verify_file(path, table["file_record"])
                else:  # verified by the pass (its size was checked by begin_single_pass)
                    self._plan.setdefault(rank, [])
            f = self._files[rank] = TensorFile(path)
        elif self._plan is not None and rank not in self._verified:
            self._plan.setdefault(rank, [])  # opened before single-pass mode: the pass verifies it too
        return f

    # -- single-pass loads (see [Note: single-pass load] in single_pass.py) ---------------
    def begin_single_pass(self, group: Any = None) -> None:
        """Defer reads into place until :meth:`finish_single_pass`, which reads each touched file once.

        Checks first that every rank tensor file exists with its recorded size, so a missing or
        truncated file fails the load before anything is read. ``group`` is the process group
        of the ranks loading together (the failure of a file is all-reduced over it).
        """
        for table in self._tables:
            check_file_size(os.path.join(self.tag_dir, table["file"]), table["file_record"])
        self._plan = {}
        self._group = group

    def finish_single_pass(self) -> None:
        """Fill the reads deferred since :meth:`begin_single_pass`, verifying this rank's share of the files.

        Collective over the group when single-pass mode is on: every rank raises a
        :class:`CheckpointError` naming the lowest-numbered file that failed on any rank. The
        destinations may then hold part of the loaded bytes (the caller must treat the state as
        invalid). Stays in single-pass mode; :meth:`end_single_pass` leaves it.
        """
        if self._plan is None:
            return
        if any(r not in self._verified for r in self._plan):
            self.touched_state = True
        try:
            read_files_once(self.tag_dir, self._tables, self._plan, self._verified, self._group)
        except BaseException:
            self._plan = {r: [] for r in self._plan}  # nothing more goes into place from this load
            raise

    def end_single_pass(self) -> None:
        """Leave single-pass mode: files not verified yet are verified whole when next opened."""
        if self._plan is not None and any(self._plan.values()):
            raise CheckpointError(
                f"checkpoint {self.tag_dir}: reads into place are still pending; call finish_single_pass first"
            )
        self._plan = None

    def rank_table(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s JSON table (fragments, RNG metadata, file record)."""
        return self._tables[rank]

    @property
    def world_size(self) -> int:
        return len(self._tables)

    def tensor_file(self, rank: int) -> TensorFile:
        """Rank ``rank``'s tensor file: checksum verified, or in single-pass mode verified by the pass."""
        return self._file(rank)

    def read(self, name: str, kind: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened value, assembled from every rank file holding them."""
        entry = self._entry(name, kind)
        numel = 1
        for d in entry.shape:
            numel *= d
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"range [{start}, {end}) is outside {kind}:{name} of {numel} elements")
        out = None
        self.touched_state = True
        for pos, take, lo, rank, key in self._covering_pieces(entry, name, kind, start, end):
            piece = self._file(rank).read(key, pos - lo, take - lo)
            if out is None and pos == start and take == end:
                return piece
            if out is None:
                out = torch.empty(end - start, dtype=entry.dtype)
            out[pos - start : take - start].copy_(piece)
        return out if out is not None else torch.empty(0, dtype=entry.dtype)

    def _covering_pieces(self, entry: _Entry, name: str, kind: str, start: int, end: int) -> Any:
        """``(pos, take, lo, rank, key)`` for each stored piece covering elements ``[start, end)`` in
        order: elements ``[pos, take)`` come from the piece starting at ``lo`` in ``rank``'s file.
        Raises if the pieces leave a gap."""
        pos = start
        for lo, hi, rank, key in entry.pieces:
            if pos >= end:
                break
            if hi <= pos:
                continue
            if lo > pos:
                break
            take = min(hi, end)
            yield pos, take, lo, rank, key
            pos = take
        if pos < end:
            raise CheckpointError(
                f"checkpoint {self.tag_dir} does not hold elements [{pos}, {end}) of {kind}:{name} "
                "(a rank file is missing from the fragment tables?)"
            )

    def read_into(self, out: torch.Tensor, name: str, kind: str, start: int = 0) -> None:
        """Fill ``out`` with elements ``[start, start + out.numel())`` of the flattened value.

        [Note: reading into place]
        ``read`` returns a fresh tensor that the caller then copies into its own storage: two
        passes over the bytes, and the fresh pages must be faulted in and zeroed by the kernel
        (together ~3x the cost of the read itself on this machine). ``read_into`` reads each
        piece with one ``preadv`` straight into the caller's tensor, when it is a contiguous CPU
        tensor of the stored dtype; otherwise it falls back to ``read`` and a converting copy.
        Under an engine load such a read is only recorded, and the bytes arrive when
        ``finish_single_pass`` reads the file (see [Note: single-pass load] in
        ``single_pass.py``): ``out`` must not be used before that.
        Every strategy's loader uses it for module weights, masters and optimizer states (see
        [Note: loading into the live state] in ``inplace.py`` for where they read to).
        """
        entry = self._entry(name, kind)
        if not torch.is_tensor(out):
            raise TypeError(f"read_into: out must be a tensor, got {type(out).__name__}")
        if out.dtype != entry.dtype or out.device.type != "cpu" or not out.is_contiguous():
            with torch.no_grad():
                out.copy_(self.read(name, kind, start, start + out.numel()).view_as(out))
            return
        end = start + out.numel()
        numel = self._numel(entry)
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"range [{start}, {end}) is outside {kind}:{name} of {numel} elements")
        flat = out.detach().view(-1)
        self.touched_state = True
        for pos, take, lo, rank, key in self._covering_pieces(entry, name, kind, start, end):
            f = self._file(rank)
            dest = flat[pos - start : take - start]
            if self._plan is not None and rank not in self._verified:
                offset, nbytes = f.byte_range(dest, key, pos - lo)  # validated now, read by the pass
                if nbytes:
                    self._plan[rank].append((offset, byte_view(dest)))
            else:
                f.read_into(dest, key, pos - lo)

    @staticmethod
    def _numel(entry: _Entry) -> int:
        numel = 1
        for d in entry.shape:
            numel *= d
        return numel

    def read_module_value_into(self, out: torch.Tensor, name: str, start: int = 0) -> None:
        """``read_module_value`` into ``out`` (in ``out``'s dtype), in place where the stored dtype matches."""
        if self.has(name, PARAM) and self.dtype(name, PARAM) == out.dtype:
            self.read_into(out, name, PARAM, start)
        elif out.dtype == torch.float32 and self.has(name, FP32):
            self.read_into(out, name, FP32, start)
        else:
            with torch.no_grad():
                out.copy_(self.read_module_value(name, out.dtype, start, start + out.numel()).view_as(out))

    def _master_kind(self, name: str) -> str:
        """Where masters come from: the saved fp32 master, or the module weight (see ``masters_from_weights``)."""
        if self.has(name, FP32) and not (self.masters_from_weights and self.has(name, PARAM)):
            return FP32
        return PARAM

    def read_fp32_into(self, out: torch.Tensor, name: str, start: int = 0) -> None:
        """``read_fp32`` into the float32 tensor ``out``, in place where the stored value is fp32."""
        kind = self._master_kind(name)
        if self.dtype(name, kind) == torch.float32:
            self.read_into(out, name, kind, start)
        else:
            with torch.no_grad():
                out.copy_(self.read_fp32(name, start, start + out.numel()).view_as(out))

    def fp32_module_value_is_master(self, name: str) -> bool:
        """Whether ``read_module_value(name, float32)`` and ``read_fp32(name)`` read the same stored value.

        They differ only when the checkpoint holds both an fp32 ``param`` and an ``fp32`` master
        for ``name``: the module value then comes from the first, the master from the second.
        A loader whose master is a view of its fp32 module weights skips the second read when
        this holds (see [Note: loading into the live state] in ``inplace.py``).
        """
        return not (
            self.has(name, FP32) and self.has(name, PARAM) and self.dtype(name, PARAM) == torch.float32
        )

    def read_full(self, name: str, kind: str) -> torch.Tensor:
        return self.read(name, kind).view(self.shape(name, kind))

    def read_fp32(self, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The fp32 master range, or the module weight upcast where no separate master was saved
        (or where ``masters_from_weights`` asks for it)."""
        return self.read(name, self._master_kind(name), start, end).float()

    def read_module_value(
        self, name: str, dtype: torch.dtype, start: int = 0, end: int | None = None
    ) -> torch.Tensor:
        """The module weight range in ``dtype``: the saved weight if it has that dtype, else from the master."""
        if self.has(name, PARAM) and self.dtype(name, PARAM) == dtype:
            return self.read(name, PARAM, start, end)
        return self.read_fp32(name, start, end).to(dtype)

    def read_optimizer_state(self, name: str, key: str, start: int = 0, end: int | None = None) -> Any:
        """A state range (elementwise) or the whole per-parameter value (tensor or Python number)."""
        kind = OPTIM_PREFIX + key
        if not self.is_elementwise(name, kind):
            t = self.read_full(name, kind)
            return t.item() if self.is_python_scalar(name, kind) else t
        return self.read(name, kind, start, end)

    def close(self) -> None:
        self._plan = None if self._plan is None else {}
        for f in self._files.values():
            f.close()
        self._files.clear()
