"""Checking stream ordering on CPU: ``RecordingAccelerator`` finds cross-stream races.

On a GPU, an op queued on one stream may run before an op queued earlier on another stream
unless a ``wait_stream`` / ``wait_event`` orders them; on the CPU everything runs in program
order, so a missing wait is invisible. ``RecordingAccelerator`` is a CPU accelerator whose
streams and events record every ``wait_stream``, ``record``, ``wait_event`` and
``record_stream``; inside :meth:`RecordingAccelerator.recording` a ``TorchDispatchMode`` tags
every aten op with the stream that is current and the storages it reads, writes and allocates.
:meth:`RecordingAccelerator.races` then replays the log as a GPU would order it (each stream
knows, per other stream, up to which log position it has waited for it: vector clocks) and
reports

* every op that reads or writes a storage last written on another stream without having
  waited for that write (a read-after-write or write-after-write race), and
* every storage allocated on one stream and used on another without a ``record_stream`` for
  the using stream (its memory could be handed out again while still in use).

Used by the tests of [Note: stage-3 streams] and zero-offload's non-blocking copies.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zero_core.accelerator.cpu import CpuAccelerator, CpuEvent, CpuStream


class _StorageIds:
    """Names storages by address and generation: an address freed and allocated again (the CPU
    allocator reuses them at once) is a different storage, told apart by a weak reference."""

    def __init__(self) -> None:
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._next = itertools.count()

    def of(self, tensor: torch.Tensor) -> int | None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        ptr = storage.data_ptr()
        known = self._live.get(ptr)
        if known is None or known[0].expired() or known[0].cdata != storage._cdata:
            known = self._live[ptr] = (StorageWeakRef(storage), next(self._next))
        return known[1]

    def all(self, values: object) -> list[int]:
        ids = (self.of(v) for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor))
        return [i for i in ids if i is not None]


class RecordingStream(CpuStream):
    """A CPU stream that records what orders it (the recorder is set per accelerator)."""

    recorder: RecordingAccelerator
    name = "?"

    def __init__(
        self, device: torch.device | str | int | None = None, priority: int = 0, name: str | None = None
    ) -> None:
        super().__init__(device, priority)
        self.name = name or f"side{next(self.recorder._ids)}"

    def wait_stream(self, stream: RecordingStream) -> None:
        self.recorder._log("wait_stream", self.name, stream.name)

    def wait_event(self, event: RecordingEvent) -> None:
        self.recorder._log("wait_event", self.name, event.id)

    def record_event(self, event: RecordingEvent | None = None) -> RecordingEvent:
        event = self.recorder.Event() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.recorder._log("stream_sync", "host", self.name)

    def __repr__(self) -> str:
        return f"RecordingStream({self.name})"


class RecordingEvent(CpuEvent):
    recorder: RecordingAccelerator

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        super().__init__(enable_timing, blocking, interprocess)
        self.id = next(self.recorder._ids)

    def record(self, stream: RecordingStream | None = None) -> None:
        super().record(stream)
        stream = self.recorder.current_stream() if stream is None else stream
        self.recorder._log("record", stream.name, self.id)

    def wait(self, stream: RecordingStream | None = None) -> None:
        stream = self.recorder.current_stream() if stream is None else stream
        stream.wait_event(self)

    def synchronize(self) -> None:
        self.recorder._log("event_sync", "host", self.id)


_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}


class _OpLog(TorchDispatchMode):
    def __init__(self, acc: RecordingAccelerator) -> None:
        super().__init__()
        self.acc = acc

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        written: list[int] = []
        schema = getattr(func, "_schema", None)
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write:
                    written += self.acc._ids_of.all(value)
        reads = self.acc._ids_of.all((args, kwargs))
        out = func(*args, **kwargs)
        made = [s for s in self.acc._ids_of.all(out) if s not in reads]
        name = str(getattr(func, "__name__", func))
        flags = {}
        if func in _COPIES:
            flags["non_blocking"] = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        self.acc._log("op", self.acc.current_stream().name, name, reads, written, made, flags)
        return out


class RecordingAccelerator(CpuAccelerator):
    """A CPU accelerator whose streams, events and ops are logged; see the module docstring."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._ids_of = _StorageIds()
        self.pinned: set[int] = set()  # addresses of the storages pin_memory was asked for
        self.log: list[tuple] = []
        self._on = False
        self.Stream = type("Stream", (RecordingStream,), {"recorder": self})
        self.Event = type("Event", (RecordingEvent,), {"recorder": self})
        super().__init__()
        self._current_stream = self.Stream(name="compute")

    def __repr__(self) -> str:
        return "RecordingAccelerator()"

    def _log(self, *entry: object) -> None:
        if self._on:
            self.log.append(entry)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Logs the request (a CPU-only machine cannot pin) with the storage it is for."""
        out = super().pin_memory(tensor)
        sid = self._ids_of.of(out)
        if sid is not None:
            self.pinned.add(out.untyped_storage().data_ptr())
        return out

    def record_stream(self, tensor: torch.Tensor, stream: RecordingStream) -> None:
        super().record_stream(tensor, stream)
        sid = self._ids_of.of(tensor)
        if sid is not None:
            self._log("record_stream", stream.name, sid)

    @contextmanager
    def recording(self) -> Iterator[list[tuple]]:
        """Log streams, events and aten ops (with their stream) inside the block."""
        self._on = True
        try:
            with _OpLog(self):
                yield self.log
        finally:
            self._on = False

    def streams_used(self) -> set[str]:
        return {e[1] for e in self.log if e[0] == "op"}

    def races(self) -> list[str]:
        """Replay the log in GPU order; see the module docstring for what is reported."""
        seen: dict[str, dict[str, int]] = {}  # stream -> other stream -> log position waited for
        events: dict[int, dict[str, int]] = {}
        last_write: dict[int, tuple[str, int]] = {}
        home: dict[int, str] = {}  # storage -> the stream that allocated it
        recorded: set[tuple[int, str]] = set()
        used_elsewhere: dict[tuple[int, str], int] = {}
        problems: list[str] = []

        def clock(stream: str) -> dict[str, int]:
            return seen.setdefault(stream, {})

        def settle(ptr: int) -> None:
            # the storage at ``ptr`` is gone (its address is allocated again) or the log ended
            for key in [k for k in used_elsewhere if k[0] == ptr]:
                pos = used_elsewhere.pop(key)
                if key not in recorded:
                    problems.append(
                        f"#{pos}: a storage allocated on {home[ptr]} is used on {key[1]} with no "
                        f"record_stream for {key[1]}"
                    )
            recorded.difference_update({k for k in recorded if k[0] == ptr})

        for pos, entry in enumerate(self.log):
            kind = entry[0]
            if kind == "wait_stream":
                mine, theirs = clock(entry[1]), clock(entry[2])
                for s, p in [*theirs.items(), (entry[2], pos)]:
                    mine[s] = max(mine.get(s, -1), p)
            elif kind == "record":
                events[entry[2]] = {**clock(entry[1]), entry[1]: pos}
            elif kind == "wait_event":
                mine = clock(entry[1])
                for s, p in events.get(entry[2], {}).items():
                    mine[s] = max(mine.get(s, -1), p)
            elif kind == "record_stream":
                recorded.add((entry[2], entry[1]))
            elif kind == "op":
                _, stream, name, reads, written, made = entry[:6]
                for ptr in set(reads) | set(written):
                    if ptr in made:
                        continue
                    w = last_write.get(ptr)
                    if w is not None and w[0] != stream and clock(stream).get(w[0], -1) < w[1]:
                        problems.append(
                            f"#{pos} {name} on {stream} uses a storage written on {w[0]} at #{w[1]} "
                            f"without waiting for it"
                        )
                    owner = home.get(ptr)
                    if owner is not None and owner != stream:
                        used_elsewhere.setdefault((ptr, stream), pos)
                for ptr in made:
                    settle(ptr)
                    home[ptr] = stream
                    last_write[ptr] = (stream, pos)
                for ptr in written:
                    last_write[ptr] = (stream, pos)
        for ptr in {k[0] for k in used_elsewhere}:
            settle(ptr)
        return problems
