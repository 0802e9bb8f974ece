"""Per-file checksums: computed while writing, verified before a file is trusted on load.

Every file of a checkpoint is recorded as ``{"bytes": n, "crc32": c}`` by the file that
refers to it (see [Note: checkpoint format] for the chain); rank tensor files also carry a
``"sum64"`` (see [Note: fast tensor-file checksum]). Both detect truncation, bit rot and
accidental edits; neither is a signature against a deliberate attacker (who could recompute
it), which is why safety against malicious files comes from never unpickling, not from the
checksum.

[Note: fast tensor-file checksum]
Loading must checksum every tensor byte once, and CRC32 (zlib) runs at ~1.3 GB/s on one core
here: slower than the disk, so it alone cost about half of a load. ``sum64`` is a Fletcher-style
checksum over the file as little-endian 64-bit words ``w_0, w_1, ...`` (the tail zero-padded):
``A = sum(w_i)`` and ``B = sum((i + 1) * w_i)``, both mod 2**64, recorded as 32 hex digits
``A || B``. ``A`` catches every single-bit error (it changes by +-2**k); the position weights
of ``B`` catch reordered words. It is computed with torch's vectorised integer ``sum``/``dot``
in cache-sized chunks at 3-4 GB/s (wrapping integer arithmetic is associative, so the
chunking does not change the value; ``sum64_reference`` is the plain-Python definition the
tests compare against). The saver computes it next to the CRC32 on its checksum thread
(see [Note: checksum overlapped with writing] in ``atomic.py``); the loader verifies ``sum64``
when a record has it and falls back to CRC32 otherwise. CRC32 is still recorded for tools that
verify without torch (the standalone ``zero_to_fp32.py``).
"""

from __future__ import annotations

import os
import warnings
import zlib

import torch

from zero_core.checkpoint.format import CheckpointError

CHECKSUM_ALGORITHM = "crc32"
_CHUNK = 8 * 2**20
_MASK = 2**64 - 1
_WORDS = 2**17  # words per torch chunk: 1 MiB, stays in cache between the sum and the dot


def file_record(nbytes: int, crc32: int, sum64: str | None = None) -> dict[str, int | str]:
    rec: dict[str, int | str] = {"bytes": int(nbytes), "crc32": int(crc32)}
    if sum64 is not None:
        rec["sum64"] = sum64
    return rec


class Sum64:
    """Streaming ``sum64`` of a byte sequence fed in pieces of any size and alignment."""

    def __init__(self) -> None:
        self._a = 0
        self._b = 0
        self._words = 0  # words folded in so far
        self._carry = b""  # < 8 bytes waiting for the rest of their word
        self._weights = torch.arange(1, _WORDS + 1, dtype=torch.int64)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self._carry:
            need = 8 - len(self._carry)
            self._carry += bytes(view[:need])
            view = view[need:]
            if len(self._carry) < 8:
                return
            self._fold(torch.frombuffer(bytearray(self._carry), dtype=torch.int64))
            self._carry = b""
        whole = len(view) - len(view) % 8
        if whole:
            with warnings.catch_warnings():  # read-only buffers (bytes) are only read here
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                words = torch.frombuffer(view[:whole], dtype=torch.int64)
            self._fold(words)
        self._carry = bytes(view[whole:])

    def _fold(self, words: torch.Tensor) -> None:
        for lo in range(0, words.numel(), _WORDS):
            chunk = words[lo : lo + _WORDS]
            n = chunk.numel()
            a = int(chunk.sum())
            b = int(torch.dot(chunk, self._weights[:n]))
            # sum((o + j + 1) * w_j) = sum((j + 1) * w_j) + o * sum(w_j), o = words before this chunk
            self._b = (self._b + b + self._words * a) & _MASK
            self._a = (self._a + a) & _MASK
            self._words += n

    def hexdigest(self) -> str:
        a, b = self._a, self._b
        if self._carry:
            w = int.from_bytes(self._carry.ljust(8, b"\0"), "little")
            a = (a + w) & _MASK
            b = (b + (self._words + 1) * w) & _MASK
        return f"{a:016x}{b:016x}"


def sum64_reference(data: bytes) -> str:
    """The definition of ``sum64`` in plain Python (slow; for tests)."""
    data = data + b"\0" * (-len(data) % 8)
    a = b = 0
    for i in range(len(data) // 8):
        w = int.from_bytes(data[8 * i : 8 * i + 8], "little")
        a = (a + w) & _MASK
        b = (b + (i + 1) * w) & _MASK
    return f"{a:016x}{b:016x}"


def _stream(path: str, fold: object) -> int:
    # One reused, already-faulted buffer: the read is a page-cache memcpy, the fold reads it hot.
    buf = torch.empty(_CHUNK, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    total = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(view):
            fold(view[:k])  # type: ignore[operator]
            total += k
    return total


def file_checksum(path: str) -> tuple[int, int]:
    """(size, crc32) of the file at ``path``, streamed in fixed-size chunks."""
    crc = 0

    def fold(v: memoryview) -> None:
        nonlocal crc
        crc = zlib.crc32(v, crc)

    return _stream(path, fold), crc


def file_sum64(path: str) -> tuple[int, str]:
    """(size, sum64) of the file at ``path`` (see [Note: fast tensor-file checksum])."""
    s = Sum64()
    return _stream(path, s.update), s.hexdigest()


def verify_file(path: str, record: dict[str, int]) -> None:
    """Raise :class:`CheckpointError` naming ``path`` unless it matches ``record``.

    Uses the record's ``sum64`` when present (fast), its ``crc32`` otherwise.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    if size != record.get("bytes"):
        raise CheckpointError(
            f"checkpoint file {path} has {size} bytes, the checkpoint recorded {record.get('bytes')}: "
            "it is truncated or was modified"
        )
    if "sum64" in record:
        _, digest = file_sum64(path)
        if digest != record["sum64"]:
            raise CheckpointError(
                f"checkpoint file {path} fails its checksum (sum64 {digest}, recorded {record['sum64']}): "
                "it is corrupted or was modified"
            )
        return
    _, crc = file_checksum(path)
    if crc != record.get("crc32"):
        raise CheckpointError(
            f"checkpoint file {path} fails its checksum (crc32 {crc:#010x}, recorded {record.get('crc32', 0):#010x}): "
            "it is corrupted or was modified"
        )
