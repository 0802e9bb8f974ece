"""Streaming reader and writer of safetensors files, with no pickle and bounded memory.

The files are standard safetensors (8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}`` plus optional ``__metadata__``, then raw bytes), so
``safetensors.safe_open`` and Hugging Face tools read them. We write and read them ourselves
because we need what the library's whole-dict API does not give:

* writing tensor by tensor, each produced on demand and dropped after it is written, so the
  peak memory of writing is one tensor, not the file (``zero_to_fp32`` depends on this);
* the byte count and CRC32 computed while writing (``integrity.py``), and the test hook of
  ``atomic.py``;
* reading any flat ``[lo, hi)`` element range of a tensor with one ``pread`` into a fresh
  tensor (resharding reads only the ranges it needs), without mapping the whole file.

The header is validated strictly on open (offsets inside the file, sizes matching dtype and
shape, known dtypes), so a truncated or foreign file (a pickle, a zip) gives a clear error
naming it instead of garbage or code execution.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zero_core.checkpoint.atomic import AtomicWriter
from zero_core.checkpoint.format import CheckpointError

_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_CODE = {v: k for k, v in _CODES.items()}
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its name, shape and dtype up front, its value produced on demand."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _header_bytes(entries: list[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    for e in entries:
        if e.dtype not in _CODES:
            raise CheckpointError(f"tensor {e.name!r}: dtype {e.dtype} cannot be stored in safetensors")
        if e.name in header:
            raise CheckpointError(f"tensor name {e.name!r} appears twice in one file")
        header[e.name] = {
            "dtype": _CODES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [off, off + e.nbytes],
        }
        off += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section 8-byte aligned, as the safetensors library does
    return struct.pack("<Q", len(raw)) + raw


def _as_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def write_tensor_file(
    path: str,
    entries: Iterable[TensorEntry],
    *,
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[TensorEntry], None] | None = None,
) -> tuple[int, int]:
    """Write ``entries`` atomically to ``path``, one tensor in memory at a time; returns (bytes, crc32)."""
    entries = list(entries)
    with AtomicWriter(path) as w:
        w.write(_header_bytes(entries, metadata))
        for e in entries:
            t = e.produce()
            if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                raise CheckpointError(
                    f"tensor {e.name!r} for {path}: announced {tuple(e.shape)} {e.dtype}, produced "
                    f"{tuple(t.shape)} {t.dtype}"
                )
            if t.numel():
                w.write(_as_bytes(t))
            del t
            if on_tensor is not None:
                on_tensor(e)
    return w.nbytes, w.crc32


class TensorFile:
    """Read tensors, or flat element ranges of them, from a safetensors file (never unpickles)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} does not exist")
        self.size = os.path.getsize(path)
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._entries, self.metadata, self._data_start = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a valid safetensors tensor file: {why}")

    def _parse_header(
        self,
    ) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], dict[str, str], int]:
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad(f"only {self.size} bytes (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > self.size:
            raise self._bad(
                f"header length {n} does not fit the file of {self.size} bytes (truncated or not safetensors)"
            )
        raw = os.pread(self._fd, n, 8)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._bad("the header is not JSON (a pickle or other foreign file?)") from None
        if not isinstance(header, dict):
            raise self._bad("the header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise self._bad("__metadata__ is not an object")
        data_start = 8 + n
        data_size = self.size - data_start
        entries = {}
        for name, info in header.items():
            try:
                dtype = _FROM_CODE[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                lo, hi = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"entry {name!r} is malformed: {info!r}") from None
            numel = 1
            for d in shape:
                if d < 0:
                    raise self._bad(f"entry {name!r} has a negative dimension")
                numel *= d
            if hi - lo != numel * torch.empty((), dtype=dtype).element_size() or lo < 0 or hi > data_size:
                raise self._bad(
                    f"entry {name!r} claims bytes [{lo}, {hi}) of a {data_size}-byte data section for shape "
                    f"{list(shape)} {info['dtype']} (truncated?)"
                )
            entries[name] = (dtype, shape, lo, hi)
        return entries, meta, data_start

    def keys(self) -> list[str]:
        return list(self._entries)

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        dtype, shape, _, _ = self._entry(name)
        return dtype, shape

    def _entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path} has no tensor {name!r}") from None

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor ``name`` as a new 1-D tensor."""
        dtype, shape, start, end = self._entry(name)
        item = torch.empty((), dtype=dtype).element_size()
        numel = (end - start) // item
        hi = numel if hi is None else hi
        if not 0 <= lo <= hi <= numel:
            raise CheckpointError(
                f"{self.path}: range [{lo}, {hi}) is outside tensor {name!r} of {numel} elements"
            )
        out = torch.empty(hi - lo, dtype=dtype)
        buf = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        offset = self._data_start + start + lo * item
        while len(buf):
            k = os.preadv(self._fd, [buf], offset)
            if k <= 0:
                raise self._bad(f"unexpected end of file reading {name!r} (truncated?)")
            buf = buf[k:]
            offset += k
        return out

    def read_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` with its shape."""
        return self.read(name).view(self.info(name)[1])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
