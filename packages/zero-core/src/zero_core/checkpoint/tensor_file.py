"""Streaming reader and writer of safetensors files, with no pickle and bounded memory.

The files are standard safetensors (8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}`` plus optional ``__metadata__``, then raw bytes), so
``safetensors.safe_open`` and Hugging Face tools read them. We write and read them ourselves
because we need what the library's whole-dict API does not give:

* writing tensor by tensor, each produced on demand and dropped after it is written, so the
  peak memory of writing is one tensor, not the file (``zero_to_fp32`` depends on this);
* the byte count and per-piece CRC-32C computed while writing (``integrity.py``), and the test hook of
  ``atomic.py``;
* reading any flat ``[lo, hi)`` element range of a tensor with one ``pread`` into a fresh
  tensor (resharding reads only the ranges it needs), without mapping the whole file.

The header is validated strictly on open, with the rules of the safetensors library (see
:func:`check_layout`), so a truncated, forged or foreign file (a pickle, a zip) gives a clear
error naming it (and the tensor) instead of aliased data, garbage or code execution.
"""

from __future__ import annotations

import json
import math
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
_ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in _CODES}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    return torch.empty((), dtype=dtype).element_size() if size is None else size


_MAX_HEADER = 100 * 2**20


def _index(x: Any) -> int:
    """A JSON integer (not a bool, float or string)."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{x!r} is not an integer")
    return x


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its name, shape and dtype up front, its value produced on demand.

    ``temporary``: the produced tensor is a fresh copy (not live state), so even a writer with
    ``live_tensors`` checksums it inline and drops it after its write.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]
    temporary: bool = False

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _itemsize(self.dtype)


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


def _as_bytes(t: torch.Tensor) -> tuple[memoryview, bool]:
    """The bytes of ``t`` flattened, and whether they are ``t``'s own memory (no copy was made)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    shared = t.device.type == "cpu" and flat.data_ptr() == t.data_ptr()
    return memoryview(flat.view(torch.uint8).numpy()), shared


def write_tensor_file(
    path: str,
    entries: Iterable[TensorEntry],
    *,
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[TensorEntry], None] | None = None,
    live_tensors: bool = False,
) -> dict[str, int | str]:
    """Write ``entries`` atomically to ``path``, one tensor in memory at a time.

    Returns the file's integrity record (``integrity.file_record``: bytes and per-piece crc32c).
    ``live_tensors`` promises that each produced tensor is (a view of) memory that outlives this
    call unmodified, e.g. the training state being saved: such tensors are then checksummed by
    a helper thread while the file is written (see [Note: checksum overlapped with writing] in
    ``atomic.py``). Tensors produced as temporaries (a copy to CPU) are checksummed as they are
    written either way, so that a streaming writer keeps one tensor in memory.
    """
    entries = list(entries)
    with AtomicWriter(path, defer_checksum=live_tensors, crc32=False, crc32c=True) as w:
        w.write(_header_bytes(entries, metadata), stable=True)  # bytes are immutable
        for e in entries:
            t = e.produce()
            if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                raise CheckpointError(
                    f"tensor {e.name!r} for {path}: announced {tuple(e.shape)} {e.dtype}, produced "
                    f"{tuple(t.shape)} {t.dtype}"
                )
            if t.numel():
                data, shared = _as_bytes(t)
                w.write(data, stable=live_tensors and shared and not e.temporary)
                del data
            del t
            if on_tensor is not None:
                on_tensor(e)
    return w.record()


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"tensor {dup!r} appears twice in the header")
    return dict(pairs)


def parse_header_json(raw: bytes) -> dict[str, Any]:
    """The safetensors header object; ``ValueError`` if it is not JSON, not an object, or repeats a key."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("the header is not JSON (a pickle or other foreign file?)") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header


def check_layout(spans: dict[str, tuple[int, int, int]], data_size: int) -> None:
    """Raise ``ValueError`` naming the tensor unless the data section is laid out as safetensors requires.

    ``spans`` maps each tensor to ``(lo, hi, nbytes)``: its ``data_offsets`` and the byte count
    its dtype and shape imply. As the safetensors library checks: ordered by offset, the
    tensors tile the data section exactly, each starting where the previous ended (no overlap,
    which would alias two tensors' data, and no gap), the first at 0 and the last ending at the
    end of the file; each span holds exactly its dtype-and-shape's bytes.
    """
    pos = 0
    for name, (lo, hi, nbytes) in sorted(spans.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if hi - lo != nbytes:
            raise ValueError(
                f"tensor {name!r} spans bytes [{lo}, {hi}) but its dtype and shape need {nbytes} bytes"
            )
        if lo != pos:
            what = "overlaps the previous tensor" if lo < pos else f"leaves a gap after byte {pos}"
            raise ValueError(f"tensor {name!r} at bytes [{lo}, {hi}) {what} (offsets must be contiguous)")
        pos = hi
    if pos != data_size:
        raise ValueError(
            f"the tensors end at byte {pos} of a {data_size}-byte data section (truncated, or trailing bytes)"
        )


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` as a writable memoryview of its own memory."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"byte_view: expected a contiguous CPU tensor, got one on {t.device}")
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy())


class TensorFile:
    """Read tensors, or flat element ranges of them, from a safetensors file (never unpickles)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} does not exist")
        self.size = os.path.getsize(path)
        self.bytes_read = 0  # tensor bytes read so far (read / read_into)
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._entries, self.metadata, self._data_start = self._parse_header()
        except BaseException:
            self.close()  # also marks the fd closed: __del__ must not close its number again (reused by then)
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
            header = parse_header_json(raw)
        except ValueError as e:
            raise self._bad(str(e)) from None
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise self._bad("__metadata__ is not an object")
        data_start = 8 + n
        entries = {}
        for name, info in header.items():
            try:
                dtype = _FROM_CODE[info["dtype"]]
                shape = tuple(_index(d) for d in info["shape"])
                lo, hi = (_index(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"entry {name!r} is malformed: {info!r}") from None
            if any(d < 0 for d in shape) or lo < 0 or hi < 0:
                raise self._bad(f"entry {name!r} has a negative dimension or offset: {info!r}")
            entries[name] = (dtype, shape, lo, hi)
        spans = {k: (lo, hi, math.prod(shape) * _itemsize(dt)) for k, (dt, shape, lo, hi) in entries.items()}
        try:
            check_layout(spans, self.size - data_start)
        except ValueError as e:
            raise self._bad(str(e)) from None
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
        dtype, _, start, end = self._entry(name)
        numel = (end - start) // _itemsize(dtype)
        hi = numel if hi is None else hi
        if not 0 <= lo <= hi <= numel:
            raise CheckpointError(
                f"{self.path}: range [{lo}, {hi}) is outside tensor {name!r} of {numel} elements"
            )
        out = torch.empty(hi - lo, dtype=dtype)
        self.read_into(out, name, lo)
        return out

    def byte_range(self, out: torch.Tensor, name: str, lo: int = 0) -> tuple[int, int]:
        """``(file offset, byte count)`` of elements ``[lo, lo + out.numel())`` of ``name``, read into ``out``.

        ``out`` must be a contiguous CPU tensor of the stored dtype: the bytes go from the file
        into it with no intermediate buffer (see [Note: reading into place] in fragments.py).
        """
        dtype, _, start, end = self._entry(name)
        if out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise CheckpointError(
                f"{self.path}: cannot read {name!r} ({dtype}) into a {out.dtype} tensor on {out.device} "
                f"(contiguous: {out.is_contiguous()}); pass a contiguous CPU tensor of the stored dtype"
            )
        item = _itemsize(dtype)
        numel = (end - start) // item
        hi = lo + out.numel()
        if not 0 <= lo <= hi <= numel:
            raise CheckpointError(
                f"{self.path}: range [{lo}, {hi}) is outside tensor {name!r} of {numel} elements"
            )
        return self._data_start + start + lo * item, out.numel() * item

    def read_into(self, out: torch.Tensor, name: str, lo: int = 0) -> None:
        """Fill ``out`` with elements ``[lo, lo + out.numel())`` of tensor ``name``, straight from the file.

        ``out`` must be a contiguous CPU tensor of the stored dtype (see :meth:`byte_range`).
        """
        offset, nbytes = self.byte_range(out, name, lo)
        if not nbytes:
            return
        buf = byte_view(out)
        self.bytes_read += nbytes
        while len(buf):
            k = os.preadv(self._fd, [buf], offset)
            if k <= 0:
                raise self._bad(f"unexpected end of file reading {name!r} (truncated?)")
            buf = buf[k:]
            offset += k

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
