#!/usr/bin/env python
"""Consolidate a zero checkpoint into one fp32 state dict (``deepspeed.utils.zero_to_fp32``).

Usage as a script (this file is also copied into every checkpoint directory)::

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT [--tag TAG] [--max-shard-size 5GB]
                           [--exclude-frozen-parameters] [--bin] [-q]

``CHECKPOINT_DIR`` is the directory holding ``latest`` and the tag directories (a tag
directory itself also works). ``OUTPUT`` is a ``.safetensors`` file (or ``.bin`` with
``--bin``); when the model is larger than ``--max-shard-size`` it becomes Hugging Face style
shards ``<stem>-00001-of-0000N.safetensors`` next to it plus ``<OUTPUT>.index.json``.

[Note: standalone conversion script]
Like DeepSpeed's, the copy of this file inside a checkpoint must run on a machine without
this repository: it imports only the standard library (torch lazily, only where a tensor must
be made; numpy lazily, to verify the ``sum64`` checksum of rank tensor files; ``tqdm`` for the
progress bar when present), never ``zero_core``. It therefore carries its own minimal reader of the
format described in [Note: checkpoint format] (``zero_core/checkpoint/format.py``): JSON
tables, CRC32 and sum64 checksums (a copy of ``integrity.Sum64``, see [Note: fast tensor-file
checksum]), the safetensors header, and the assembly of a parameter from the
fragments of every rank file. It only reads whole values, which is all consolidation needs;
the engine's ranged, resharding reader is ``fragments.CheckpointReader``. When ``zero_core``
is importable its ``CheckpointError`` is raised, so library callers catch one error type.
Tests run the copied file in a subprocess with ``zero_core`` blocked, and compare its output
with the engine's gathered masters.

[Note: streaming conversion]
A safetensors output is written header first (every offset is known from the fragment
tables), then each tensor's bytes are copied from the rank files straight into the output
with ``os.copy_file_range`` (kernel to kernel; a 4 MiB buffer where that is unavailable),
piece by piece in flat order. When the stored dtype is already the output dtype (the fp32
masters, buffers) no tensor is ever built and torch is not even imported: the peak memory of
the conversion is the interpreter plus small buffers (~20 MB), independent of the model and
shard size. Only a value that must change dtype (a 16-bit weight without an fp32 master,
e.g. a frozen bf16 parameter) is assembled as one tensor with torch and written whole, so the
peak is then about the largest such tensor. ``.bin`` output (on request) needs one whole
shard in memory, since ``torch.save`` takes a dict. Nothing is unpickled on the way in.
Outputs are written to a temporary name, fsynced and renamed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

if __package__ == "zero_core.checkpoint":  # one error type for library callers
    from zero_core.checkpoint.format import CheckpointError
else:  # the standalone copy (see [Note: standalone conversion script]) must not import torch via zero_core

    class CheckpointError(RuntimeError):  # type: ignore[no-redef]
        """A checkpoint cannot be read; the message names the file and what is wrong."""


__all__ = [
    "CheckpointError",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "parse_size",
]

FORMAT_NAME = "zero-checkpoint"
FORMAT_VERSION = 3  # as zero_core/checkpoint/format.py
COMMIT_FILE = "checkpoint.json"
LATEST_FILE = "latest"
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}$")
# dtypes by the names the JSON tables use: (safetensors code, bytes per element)
_DTYPES = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}
_FROM_ST_CODE = {code: name for name, (code, _) in _DTYPES.items()}
_CHUNK = 8 * 2**20
_COPY_CHUNK = 4 * 2**20


def _torch() -> ModuleType:
    import torch  # only where a tensor must be made: see [Note: streaming conversion]

    return torch


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units as Hugging Face; KiB/MiB/GiB binary)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = _SIZE_RE.match(size) if isinstance(size, str) else None
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"max_shard_size must be a positive byte count or a string like '5GB', '500MB', got {size!r}"
        )
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


# -- reading -------------------------------------------------------------------------------
def _decode_hook(obj: dict[str, object]) -> object:
    """inf/nan are stored as {"__float__": "inf"}, dict keys that look like it escaped (format.py's
    [Note: JSON float tags]; repeated here so that this file runs without zero_core)."""
    if len(obj) == 1 and "__float__" in obj:
        return float(obj["__float__"])
    if any(k.startswith("__zero_key__") for k in obj):
        return {k[len("__zero_key__") :] if k.startswith("__zero_key__") else k: v for k, v in obj.items()}
    return obj


def _encode(value: object) -> object:
    """The inverse of :func:`_decode_hook` (format.py's ``_encode_floats``), to recompute a seal."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, dict):
        esc = {
            k: "__zero_key__" + k if k == "__float__" or k.startswith("__zero_key__") else k for k in value
        }
        return {esc[k]: _encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


def _check_seal(meta: dict[str, Any], path: str) -> None:
    """The seal of ``checkpoint.json`` (metadata.py's [Note: sealed metadata]), required from format 3."""
    if "seal" not in meta:
        if int(meta.get("format_version", 0)) >= 3:
            raise CheckpointError(f"{path} has no seal (its checksum): it was truncated or edited")
        return
    crc32c = _crc32c(path)
    body = {k: v for k, v in meta.items() if k != "seal"}
    data = json.dumps(_encode(body), indent=1, sort_keys=True, allow_nan=False).encode()
    if crc32c.crc32c(data) != meta["seal"]:
        raise CheckpointError(f"{path} fails its checksum (seal): it is corrupted or was edited by hand")


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return json.loads(data.decode("utf-8"), object_hook=_decode_hook)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the file is corrupted") from None


def _file_sum64(path: str) -> str:
    """``sum64`` of the file (the definition is in zero_core/checkpoint/integrity.py)."""
    try:
        import numpy as np
    except ImportError:
        raise CheckpointError(
            f"verifying {path} needs numpy (its checksum is sum64); install it with `pip install numpy`"
        ) from None
    mask, words = 2**64 - 1, 2**17
    weights = np.arange(1, words + 1, dtype=np.uint64)
    a = b = seen = 0

    def fold(data: bytes | memoryview) -> None:
        nonlocal a, b, seen
        w = np.frombuffer(data, dtype="<u8")
        for lo in range(0, w.size, words):
            chunk = w[lo : lo + words]
            ca = int(chunk.sum(dtype=np.uint64))
            b = (b + int(np.dot(chunk, weights[: chunk.size])) + seen * ca) & mask
            a = (a + ca) & mask
            seen += chunk.size

    buf, carry = bytearray(_CHUNK), b""
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            data = carry + bytes(buf[:k]) if carry else memoryview(buf)[:k]
            whole = len(data) - len(data) % 8
            fold(data[:whole])
            carry = bytes(data[whole:])  # a short read can split a word
    if carry:
        fold(carry.ljust(8, b"\0"))
    return f"{a:016x}{b:016x}"


def _crc32c(path: str) -> ModuleType:
    try:
        import crc32c
    except ImportError:
        raise CheckpointError(
            f"verifying {path} needs the crc32c package (its checksum is CRC-32C); install it with "
            "`pip install crc32c`"
        ) from None
    return crc32c


def _file_crc32c(path: str, chunk: int) -> list[int]:
    """CRC-32C of each ``chunk``-byte piece of the file (the definition is in integrity.py)."""
    crc32c = _crc32c(path)
    out, buf = [], bytearray(min(_CHUNK, chunk))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            crc, left = 0, chunk
            while left and (k := f.readinto(view[: min(len(buf), left)])):
                crc = crc32c.crc32c(view[:k], crc)
                left -= k
            if left == chunk:  # nothing read: end of file
                return out or [0]
            out.append(crc)


def _verify(path: str, record: dict[str, Any]) -> None:
    """Raise naming ``path`` unless its size and checksum (crc32c; old: sum64, else CRC32) match ``record``."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    if size != record.get("bytes"):
        raise CheckpointError(
            f"checkpoint file {path} has {size} bytes, the checkpoint recorded {record.get('bytes')}: "
            "it is truncated or was modified"
        )
    if "crc32c" in record:
        chunk = record.get("crc32c_chunk")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 < chunk <= 2**28:
            raise CheckpointError(f"the record of checkpoint file {path} has crc32c_chunk {chunk!r}")
        if _file_crc32c(path, chunk) != record["crc32c"]:
            raise CheckpointError(
                f"checkpoint file {path} fails its checksum (crc32c): it is corrupted or was modified"
            )
        return
    if "sum64" in record:
        digest = _file_sum64(path)
        if digest != record["sum64"]:
            raise CheckpointError(
                f"checkpoint file {path} fails its checksum (sum64 {digest}, recorded {record['sum64']}): "
                "it is corrupted or was modified"
            )
        return
    if "crc32" not in record:
        raise CheckpointError(f"the record of checkpoint file {path} has no checksum: {record!r}")
    crc, buf = 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            crc = zlib.crc32(view[:k], crc)
    if crc != record["crc32"]:
        raise CheckpointError(
            f"checkpoint file {path} fails its checksum (crc32 {crc:#010x}, recorded {record['crc32']:#010x}): "
            "it is corrupted or was modified"
        )


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key appears twice: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    return dict(pairs)


def _entries(header: object, data_size: int) -> dict[str, tuple[str, int, int]]:
    """``key -> (dtype name, lo, hi)``, after the checks of ``tensor_file.check_layout`` (safetensors' rules)."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    spans = []
    for k, v in header.items():
        dims, offsets = list(v["shape"]), list(v["data_offsets"])
        if (
            any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in dims + offsets)
            or len(offsets) != 2
        ):
            raise ValueError(f"tensor {k!r} has a malformed shape or data_offsets: {v!r}")
        dtype = _FROM_ST_CODE[v["dtype"]]
        spans.append((offsets[0], offsets[1], k, dtype, math.prod(dims) * _DTYPES[dtype][1]))
    pos = 0
    for lo, hi, k, _, nbytes in sorted(spans):
        if hi - lo != nbytes:
            raise ValueError(f"tensor {k!r} spans bytes [{lo}, {hi}) but its dtype and shape need {nbytes}")
        if lo != pos:
            what = "overlaps the previous tensor" if lo < pos else f"leaves a gap after byte {pos}"
            raise ValueError(f"tensor {k!r} at bytes [{lo}, {hi}) {what} (offsets must be contiguous)")
        pos = hi
    if pos != data_size:
        raise ValueError(f"the tensors end at byte {pos} of a {data_size}-byte data section")
    return {k: (dtype, lo, hi) for lo, hi, k, dtype, _ in spans}


class _RankFile:
    """The tensors of one rank's safetensors file: header parsed strictly, data read by ``pread``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            self.close()
            raise self._bad("the header length does not fit the file (truncated or not safetensors)")
        self.data_start = 8 + n
        try:
            header = json.loads(os.pread(self.fd, n, 8).decode("utf-8"), object_pairs_hook=_unique)
        except (UnicodeDecodeError, ValueError) as e:
            self.close()
            raise self._bad(
                f"the header is not safetensors JSON ({e}; a pickle or other foreign file?)"
            ) from None
        try:
            self.entries = _entries(header, size - self.data_start)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            self.close()
            raise self._bad(f"{e} (a forged or foreign file?)") from None

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a valid safetensors tensor file: {why}")

    def _span(self, key: str, dtype: str, nbytes: int) -> int:
        """File offset of tensor ``key``, checked against what its fragment record says."""
        if key not in self.entries:
            raise CheckpointError(f"{self.path} has no tensor {key!r}")
        have, lo, hi = self.entries[key]
        if have != dtype or hi - lo != nbytes:
            raise self._bad(f"entry {key!r} does not match its fragment record")
        return self.data_start + lo

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill the 1-D contiguous ``out`` with the whole tensor ``key`` (same dtype and size)."""
        torch = _torch()
        dtype = str(out.dtype).removeprefix("torch.")
        offset = self._span(key, dtype, out.numel() * out.element_size())
        buf = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        while len(buf):
            k = os.preadv(self.fd, [buf], offset)
            if k <= 0:
                raise self._bad(f"unexpected end of file reading {key!r} (truncated?)")
            buf, offset = buf[k:], offset + k

    def copy_to(self, key: str, dtype: str, nbytes: int, out_fd: int) -> None:
        """Append the raw bytes of tensor ``key`` to ``out_fd`` (at its position), no tensor made.

        See [Note: streaming conversion]: ``copy_file_range`` moves the bytes inside the kernel;
        where it is unsupported (old kernels, some filesystems) a small buffer is reused.
        """
        offset = self._span(key, dtype, nbytes)
        end = offset + nbytes
        while offset < end and _copy_file_range_ok[0]:
            try:
                k = os.copy_file_range(self.fd, out_fd, min(end - offset, 2**30), offset)
            except (AttributeError, OSError):
                _copy_file_range_ok[0] = False
                break
            if k <= 0:
                raise self._bad(f"unexpected end of file reading {key!r} (truncated?)")
            offset += k
        buf = bytearray(min(_COPY_CHUNK, end - offset))
        view = memoryview(buf)
        while offset < end:
            k = os.preadv(self.fd, [view[: end - offset]], offset)
            if k <= 0:
                raise self._bad(f"unexpected end of file reading {key!r} (truncated?)")
            out = view[:k]
            while out:
                out = out[os.write(out_fd, out) :]
            offset += k

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_copy_file_range_ok = [hasattr(os, "copy_file_range")]  # cleared the first time the kernel refuses it


class _Checkpoint:
    """One verified tag: ``(name, kind) -> [(start, end, rank, key)]``, rank files opened lazily."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str], tag: str | int | None) -> None:
        if not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise TypeError(f"checkpoint_dir must be a path, got {type(checkpoint_dir).__name__}")
        checkpoint_dir = os.fspath(checkpoint_dir)
        if tag is None and os.path.isfile(os.path.join(checkpoint_dir, COMMIT_FILE)):
            checkpoint_dir, tag = os.path.split(os.path.abspath(checkpoint_dir))
        if tag is None:
            latest = os.path.join(checkpoint_dir, LATEST_FILE)
            if not os.path.isfile(latest):
                raise CheckpointError(
                    f"{checkpoint_dir} has no 'latest' file; pass tag= (one of its tag directories)"
                )
            with open(latest, encoding="utf-8") as f:
                tag = f.read().strip()
        tag = str(tag)
        if not _TAG_RE.match(tag):
            raise CheckpointError(f"{tag!r} is not a valid checkpoint tag")
        self.tag_dir = _tag_dir(checkpoint_dir, tag)
        commit = os.path.join(self.tag_dir, COMMIT_FILE)
        meta = _read_json(commit)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{commit} is not a zero checkpoint record")
        _check_seal(meta, commit)
        if int(meta.get("format_version", -1)) > FORMAT_VERSION:
            raise CheckpointError(
                f"{commit} has format version {meta['format_version']}; this script reads up to {FORMAT_VERSION}"
            )
        self.meta = meta
        self.tables = []
        for r in range(int(meta["world_size"])):
            name = f"rank_{r:05d}.json"
            if name not in meta.get("files", {}):
                raise CheckpointError(f"{commit} has no record of {name}")
            _verify(os.path.join(self.tag_dir, name), meta["files"][name])
            self.tables.append(_read_json(os.path.join(self.tag_dir, name)))
        self.index: dict[tuple[str, str], dict[str, Any]] = {}
        for r, table in enumerate(self.tables):
            for rec in table["fragments"]:
                e = self.index.setdefault((rec["name"], rec["kind"]), {"rec": rec, "pieces": []})
                e["pieces"].append((int(rec["start"]), int(rec["end"]), r, rec["key"]))
        for e in self.index.values():
            e["pieces"].sort()
        self._files: dict[int, _RankFile] = {}

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.index

    def names(self, kind: str) -> list[str]:
        return [n for (n, k) in self.index if k == kind]

    def shape_dtype(self, name: str, kind: str) -> tuple[tuple[int, ...], str]:
        """Shape and dtype name (``"float32"``) of a stored value."""
        rec = self.index[(name, kind)]["rec"]
        if rec["dtype"] not in _DTYPES:
            raise CheckpointError(f"{self.tag_dir}: unknown dtype {rec['dtype']!r} of {kind}:{name}")
        return tuple(int(d) for d in rec["shape"]), rec["dtype"]

    def _pieces(self, name: str, kind: str) -> list[tuple[int, int, int, str]]:
        """The pieces covering the whole value once, in flat order; an error if some are missing."""
        shape, _ = self.shape_dtype(name, kind)
        numel = math.prod(shape)
        out, pos = [], 0
        for lo, hi, rank, key in self.index[(name, kind)]["pieces"]:
            if lo != pos:
                break
            out.append((lo, hi, rank, key))
            pos = hi
        if pos != numel:
            raise CheckpointError(
                f"checkpoint {self.tag_dir} does not hold all of {kind}:{name} (a rank file is missing?)"
            )
        return out

    def _file(self, rank: int) -> _RankFile:
        if rank not in self._files:
            table = self.tables[rank]
            path = os.path.join(self.tag_dir, table["file"])
            _verify(path, table["file_record"])
            self._files[rank] = _RankFile(path)
        return self._files[rank]

    def read_full(self, name: str, kind: str) -> torch.Tensor:
        """The whole value, each rank's piece read straight into its slice of one buffer."""
        torch = _torch()
        shape, dtype = self.shape_dtype(name, kind)
        out = torch.empty(math.prod(shape), dtype=getattr(torch, dtype))
        for lo, hi, rank, key in self._pieces(name, kind):
            self._file(rank).read_into(key, out[lo:hi])
        return out.view(shape)

    def copy_to(self, name: str, kind: str, out_fd: int) -> None:
        """Append the raw bytes of the whole value to ``out_fd``, piece by piece, no tensor made."""
        _, dtype = self.shape_dtype(name, kind)
        item = _DTYPES[dtype][1]
        for lo, hi, rank, key in self._pieces(name, kind):
            self._file(rank).copy_to(key, dtype, (hi - lo) * item, out_fd)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _tag_dir(checkpoint_dir: str, tag: str) -> str:
    """``checkpoint_dir/tag``; if a crash interrupted replacing that tag, the complete copy set aside."""
    for name in (tag, f".{tag}.old"):  # see [Note: replacing a tag] in staged.py
        d = os.path.join(checkpoint_dir, name)
        if os.path.isfile(os.path.join(d, COMMIT_FILE)):
            return d
    d = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(d):
        raise CheckpointError(f"checkpoint tag directory {d} does not exist")
    raise CheckpointError(f"{os.path.join(d, COMMIT_FILE)} is missing: {d} is not a complete zero checkpoint")


#: Readers ``(checkpoint_dir, tag) -> checkpoint or None`` tried before the engine checkpoint's own.
#: ``zero_core.checkpoint`` adds the one of the module-only directories of zero-pipe and zero-moe
#: (see [Note: module-only checkpoint directories] in ``module_dirs.py``), which builds on this
#: file's reader; the standalone copy has none.
EXTRA_READERS: list[Any] = []


def _open(checkpoint_dir: str | os.PathLike[str], tag: str | int | None) -> _Checkpoint:
    """The checkpoint to convert: the first of :data:`EXTRA_READERS` that recognises it, else an
    engine checkpoint."""
    if isinstance(checkpoint_dir, (str, os.PathLike)):
        for reader in EXTRA_READERS:
            found = reader(checkpoint_dir, tag)
            if found is not None:
                return found
    return _Checkpoint(checkpoint_dir, tag)


def _plan(ckpt: _Checkpoint, exclude_frozen: bool) -> list[tuple[str, str]]:
    """(name, kind) of every output tensor, in the model's parameter order, then buffers."""
    params = ckpt.meta.get("parameters", [])
    # then names not in rank 0's list: the experts other ranks held (see experts.py in zero_core)
    order = [n for n, _, _ in params]
    seen = set(order)
    order += [n for n in dict.fromkeys(ckpt.names("fp32") + ckpt.names("param")) if n not in seen]
    frozen = {n for n, rg, _ in params if not rg}
    out = []
    for name in order:
        if exclude_frozen and name in frozen:
            continue
        if ckpt.has(name, "fp32"):
            out.append((name, "fp32"))
        elif ckpt.has(name, "param"):
            out.append((name, "param"))
    return out + [(n, "buffer") for n in ckpt.names("buffer")]


def _aliases(ckpt: _Checkpoint, kept: Iterable[str]) -> list[tuple[str, str]]:
    """``(alias, owner)`` of the tied parameters whose owner is in ``kept`` (older checkpoints: none)."""
    kept = set(kept)
    return [(a, o) for a, o in ckpt.meta.get("shared_parameters", []) if o in kept and a not in kept]


def _out_dtype(ckpt: _Checkpoint, name: str, kind: str) -> str:
    """Buffers keep their dtype; weights come out fp32 (the master, or the weight upcast where none was saved)."""
    return ckpt.shape_dtype(name, kind)[1] if kind == "buffer" else "float32"


def _value(ckpt: _Checkpoint, name: str, kind: str) -> torch.Tensor:
    t = ckpt.read_full(name, kind)
    return t if kind == "buffer" else t.float()


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | int | None = None,
    exclude_frozen_parameters: bool = False,
) -> dict[str, torch.Tensor]:
    """The consolidated fp32 weights (and buffers) of a checkpoint, as an in-memory state dict on CPU."""
    ckpt = _open(checkpoint_dir, tag)
    try:
        out = {n: _value(ckpt, n, k) for n, k in _plan(ckpt, exclude_frozen_parameters)}
        for alias, owner in _aliases(ckpt, out):  # tied weights: the same tensor under both names
            out[alias] = out[owner]
        return out
    finally:
        ckpt.close()


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | int | None = None
) -> torch.nn.Module:
    """Load the consolidated fp32 weights into ``model`` (moved to CPU) and return it.

    The model is no longer usable with the engine it came from: re-create the engine to continue training.
    """
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"load_state_dict_from_zero_checkpoint: model must be a torch.nn.Module, got {type(model)}"
        )
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


# -- writing -------------------------------------------------------------------------------
class _Progress:
    """tqdm when installed, else a line every 10%."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self._next = max(total, 1), 0, enabled, 0.1
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="zero_to_fp32")
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and self.done / self.total >= self._next:
            print(f"zero_to_fp32: {100 * self.done / self.total:.0f}% ({self.done} bytes)", flush=True)
            self._next += 0.1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _Out:
    """One output tensor: its name, shape and dtype name, and where its value comes from."""

    def __init__(self, ckpt: _Checkpoint, name: str, kind: str, source: str | None = None) -> None:
        # ``source``: the checkpoint entry holding the values, when ``name`` is a tied parameter's
        # second name (see [Note: tied weights in converted files])
        self.ckpt, self.name, self.kind, self.source = ckpt, name, kind, source or name
        self.shape, self.src_dtype = ckpt.shape_dtype(self.source, kind)
        self.dtype = _out_dtype(ckpt, self.source, kind)
        self.nbytes = math.prod(self.shape) * _DTYPES[self.dtype][1]

    def value(self) -> torch.Tensor:
        return _value(self.ckpt, self.source, self.kind)

    def write(self, fd: int) -> None:
        """Append the value's bytes to ``fd``: copied as stored, or converted with torch when the dtype changes."""
        if self.src_dtype == self.dtype:
            self.ckpt.copy_to(self.source, self.kind, fd)  # no tensor: see [Note: streaming conversion]
            return
        t = self.value()
        if t.numel():
            view = memoryview(t.reshape(-1).view(_torch().uint8).numpy())
            while view:
                view = view[os.write(fd, view) :]


def _shards(entries: list[_Out], max_bytes: int) -> Iterator[list[_Out]]:
    shard: list[_Out] = []
    size = 0
    for e in entries:
        if shard and size + e.nbytes > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append(e)
        size += e.nbytes
    if shard:
        yield shard


def _atomic_fd(path: str, fill: Callable[[int, str], None]) -> None:
    """Create ``path`` atomically: ``fill(fd, tmp)`` writes the temporary file ``tmp`` (through the
    open ``fd`` or by its name), which is then fsynced and renamed.

    The converter's one writer (it cannot use zero_core's: See [Note: one atomic writer] in
    ``zero_core/checkpoint/atomic.py``)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fill(fd, tmp)
        os.fsync(fd)  # the file's data, however written
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _with_tied_copies(ckpt: _Checkpoint, entries: list[_Out]) -> list[_Out]:
    """``entries`` with each tied parameter's second name right after its owner, as a copy.

    [Note: tied weights in converted files]
    A checkpoint records tied parameters (``head.weight`` is ``emb.weight``) once, under the
    owner's name, with the pairs in its metadata (``shared_parameters``). A converted file must
    load into the model with a plain, strict ``model.load_state_dict(load_file(path))``, which
    needs every name of the model's state dict. safetensors cannot store two names for one
    storage, so the second name is written as its own copy of the owner's values (the file
    grows by that tensor's size), and the file's ``__metadata__["tied_parameters"]`` lists the
    ``[alias, owner]`` pairs so a reader can tell (loading both names into the model keeps the
    tie: ``load_state_dict`` copies into the one shared parameter). ``.bin`` files and the
    in-memory state dict hold the alias as the same tensor, as ``torch.save`` does.
    """
    owners: dict[str, list[str]] = {}
    for alias, owner in _aliases(ckpt, [e.name for e in entries]):
        owners.setdefault(owner, []).append(alias)
    out: list[_Out] = []
    for e in entries:
        out.append(e)
        out += [_Out(ckpt, alias, e.kind, source=e.name) for alias in owners.get(e.name, [])]
    return out


def _write_safetensors(path: str, shard: list[_Out], progress: _Progress) -> None:
    """A standard safetensors file: header first, then each tensor streamed (see [Note: streaming conversion])."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    tied = [[e.name, e.source] for e in shard if e.source != e.name]
    if tied:  # See [Note: tied weights in converted files]
        header["__metadata__"]["tied_parameters"] = json.dumps(tied)
    off = 0
    for e in shard:
        header[e.name] = {
            "dtype": _DTYPES[e.dtype][0],
            "shape": list(e.shape),
            "data_offsets": [off, off + e.nbytes],
        }
        off += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)

    def fill(fd: int, tmp: str) -> None:
        _write_all(fd, struct.pack("<Q", len(raw)) + raw)
        for e in shard:
            e.write(fd)
            progress.update(e.nbytes)
        written = os.lseek(fd, 0, os.SEEK_CUR)
        if written != 8 + len(raw) + off:
            raise CheckpointError(f"{path}: wrote {written} bytes, expected {8 + len(raw) + off}")

    _atomic_fd(path, fill)


def _write_bin(path: str, shard: list[_Out], progress: _Progress, aliases: list[tuple[str, str]]) -> None:
    torch = _torch()
    state = {e.name: e.value() for e in shard}
    state.update({a: state[o] for a, o in aliases if o in state})  # tied: torch.save stores it once

    _atomic_fd(path, lambda fd, tmp: torch.save(state, tmp))  # by name: the bytes torch.save(path) writes
    progress.update(sum(e.nbytes for e in shard))


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


_WEIGHT_SUFFIXES = (".safetensors", *_PICKLE_SUFFIXES)


def _resolve_output(
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str,
    safe_serialization: bool,
    tag: str | int | None,
) -> tuple[str, str | int | None, int]:
    """The output file (a directory gets Hugging Face's name), the tag (DeepSpeed < 0.16's third
    positional argument) and the shard size limit in bytes; clear errors for a mismatched name."""
    if not isinstance(output_dir, (str, os.PathLike)):
        raise TypeError(f"output_dir must be a path, got {type(output_dir).__name__}")
    output_file = os.fspath(output_dir)
    if tag is None and isinstance(max_shard_size, str) and not _SIZE_RE.match(max_shard_size):
        # the (checkpoint_dir, output_file, tag) form of DeepSpeed < 0.16: a tag, not a size
        tag, max_shard_size = max_shard_size, "5GB"
    is_file = output_file.lower().endswith(_WEIGHT_SUFFIXES) and not os.path.isdir(output_file)
    if not is_file:
        # a directory, as DeepSpeed >= 0.16 takes: Hugging Face's file names inside it
        output_file = os.path.join(
            output_file, "model.safetensors" if safe_serialization else "pytorch_model.bin"
        )
    limit = parse_size(max_shard_size)
    # a pickle named .safetensors, or safetensors named pytorch_model.bin, fails whoever loads it by name
    suffix = os.path.splitext(output_file)[1].lower()
    if safe_serialization and suffix in _PICKLE_SUFFIXES:
        raise ValueError(
            f"output {output_file} names a torch pickle file but the format is safetensors: name it "
            ".safetensors, or pass safe_serialization=False (--bin) for a torch .bin"
        )
    if not safe_serialization and suffix == ".safetensors":
        raise ValueError(
            f"output {output_file} names a safetensors file but safe_serialization=False (--bin) writes a "
            "torch pickle: name it .bin, or drop --bin"
        )
    return output_file, tag, limit


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    tag: str | int | None = None,
    exclude_frozen_parameters: bool = False,
    progress: bool = True,
) -> list[str]:
    """Write the consolidated fp32 state dict into ``output_dir`` (sharded past ``max_shard_size``).

    The signature is DeepSpeed's (>= 0.16): ``output_dir`` is a directory (created if missing) that
    gets Hugging Face's names, ``model.safetensors`` (``pytorch_model.bin`` with
    ``safe_serialization=False``), or past ``max_shard_size`` ``model-00001-of-0000N.safetensors``
    ... with ``model.safetensors.index.json``. Unlike DeepSpeed, safetensors is the default.

    The older form ``(checkpoint_dir, output_file, tag)`` keeps working, by this rule: an output
    path whose name ends in ``.safetensors``, ``.bin``, ``.pt`` or ``.pth`` (and is not an existing
    directory) is the output *file*; and a third positional argument that is not a size (an int,
    or a string like ``"5GB"``) is that form's ``tag``.

    Streams tensor by tensor (see [Note: streaming conversion]). Returns the files written.
    A tied parameter's second name (``lm_head.weight``) is in the output too, so the file loads
    strictly into the model: see [Note: tied weights in converted files].
    """
    output_file, tag, limit = _resolve_output(output_dir, max_shard_size, safe_serialization, tag)
    ckpt = _open(checkpoint_dir, tag)
    try:
        entries = [_Out(ckpt, name, kind) for name, kind in _plan(ckpt, exclude_frozen_parameters)]
        if safe_serialization:
            entries = _with_tied_copies(ckpt, entries)
        shards = list(_shards(entries, limit))
        out_dir = os.path.dirname(os.path.abspath(output_file))
        os.makedirs(out_dir, exist_ok=True)
        stem, ext = os.path.splitext(os.path.basename(output_file))
        ext = ext or (".safetensors" if safe_serialization else ".bin")
        names = (
            [os.path.basename(output_file)]
            if len(shards) == 1
            else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}" for i in range(len(shards))]
        )
        bar = _Progress(sum(e.nbytes for e in entries), progress)
        aliases = [] if safe_serialization else _aliases(ckpt, [e.name for e in entries])
        written, weight_map = [], {}
        for fname, shard in zip(names, shards):
            path = os.path.join(out_dir, fname)
            if safe_serialization:
                _write_safetensors(path, shard, bar)
            else:
                _write_bin(path, shard, bar, aliases)
            written.append(path)
            weight_map.update({e.name: fname for e in shard})
            weight_map.update({a: fname for a, o in aliases if weight_map.get(o) == fname})
        bar.close()
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
            index_path = os.path.join(out_dir, f"{stem}{ext}.index.json")
            data = json.dumps(index, indent=2, sort_keys=True).encode()
            _atomic_fd(index_path, lambda fd, tmp: _write_all(fd, data))
            written.append(index_path)
        return written
    finally:
        ckpt.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Consolidate a zero checkpoint into an fp32 state dict.")
    parser.add_argument("checkpoint_dir", help="directory with 'latest' and tag folders (or one tag folder)")
    parser.add_argument(
        "output",
        help="output directory (model.safetensors, sharded with an index past --max-shard-size), or a "
        "file named .safetensors (.bin with --bin)",
    )
    parser.add_argument("-t", "--tag", default=None, help="tag to convert (default: the one 'latest' names)")
    # the underscore spellings are DeepSpeed's (its --safe_serialization is the default here)
    parser.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        default="5GB",
        help="shard the output past this size (default 5GB)",
    )
    parser.add_argument("--exclude-frozen-parameters", "--exclude_frozen_parameters", action="store_true")
    parser.add_argument("--bin", action="store_true", help="write torch .bin (pickle) instead of safetensors")
    parser.add_argument("--safe_serialization", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        parse_size(args.max_shard_size)  # a bad size is an error here, never taken for a tag
        files = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
            max_shard_size=args.max_shard_size,
            safe_serialization=not args.bin,
            progress=not args.quiet,
        )
    except (CheckpointError, ValueError, TypeError) as e:
        print(f"zero_to_fp32: error: {e}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    if __package__ == "zero_core.checkpoint":  # ``python -m``: the package's module, readers added
        from zero_core.checkpoint import zero_to_fp32 as _library

        sys.exit(_library.main())
    sys.exit(main())
