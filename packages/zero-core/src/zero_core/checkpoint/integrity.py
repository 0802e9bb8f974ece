"""Per-file checksums: computed while writing, verified before a file is trusted on load.

Every file of a checkpoint is recorded as ``{"bytes": n, "crc32": c}`` by the file that
refers to it (see [Note: checkpoint format] for the chain). CRC32 (zlib) detects truncation,
bit rot and accidental edits; it is not a signature against a deliberate attacker (who could
recompute it), which is why safety against malicious files comes from never unpickling,
not from the checksum.
"""

from __future__ import annotations

import os
import zlib

from zero_core.checkpoint.format import CheckpointError

CHECKSUM_ALGORITHM = "crc32"
_CHUNK = 8 * 2**20


def file_record(nbytes: int, crc32: int) -> dict[str, int]:
    return {"bytes": int(nbytes), "crc32": int(crc32)}


def file_checksum(path: str) -> tuple[int, int]:
    """(size, crc32) of the file at ``path``, streamed in fixed-size chunks."""
    crc = 0
    total = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            crc = zlib.crc32(view[:k], crc)
            total += k
    return total, crc


def verify_file(path: str, record: dict[str, int]) -> None:
    """Raise :class:`CheckpointError` naming ``path`` unless it matches ``record``."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    if size != record.get("bytes"):
        raise CheckpointError(
            f"checkpoint file {path} has {size} bytes, the checkpoint recorded {record.get('bytes')}: "
            "it is truncated or was modified"
        )
    _, crc = file_checksum(path)
    if crc != record.get("crc32"):
        raise CheckpointError(
            f"checkpoint file {path} fails its checksum (crc32 {crc:#010x}, recorded {record.get('crc32', 0):#010x}): "
            "it is corrupted or was modified"
        )
