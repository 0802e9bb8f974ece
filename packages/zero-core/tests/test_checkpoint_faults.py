"""Issue 25's checkpoint faults at the level of one file: bit flips, forged headers, edited records, a full disk.

The whole-checkpoint versions (engine and ``zero_to_fp32`` loads, kill -9 of a pipeline rank)
are the cases of ``tools/faults/checkpoint_cases.py``, run by ``tests/test_checkpoint_faults.py``.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import struct

import pytest
import torch
from zero_core.checkpoint import CheckpointError, atomic
from zero_core.checkpoint.integrity import (
    Crc32cChunks,
    FileChecksum,
    crc32c_reference,
    file_record,
    sum64_reference,
    verify_file,
)
from zero_core.checkpoint.metadata import check_engine_meta, read_sealed, sealed_bytes
from zero_core.checkpoint.tensor_file import TensorEntry, TensorFile, write_tensor_file


def _script():
    import importlib.util

    import zero_core.checkpoint.zero_to_fp32 as mod

    spec = importlib.util.spec_from_file_location("standalone_zero_to_fp32", mod.__file__)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_crc32c_pieces_for_any_split(chunk):
    rng = random.Random(chunk)
    data = bytes(rng.getrandbits(8) for _ in range(5000))
    c = Crc32cChunks(chunk)
    i = 0
    while i < len(data):
        k = rng.randint(1, 900)
        c.update(memoryview(data)[i : i + k])
        i += k
    assert c.digest() == crc32c_reference(data, chunk)
    assert Crc32cChunks(chunk).digest() == [0] == crc32c_reference(b"", chunk)


def test_every_error_of_up_to_3_bits_is_detected():
    """All 1- and 2-bit errors of a 96-byte file, 30,000 random 3-bit ones, and sum64's blind spots.

    The guarantee is the Hamming distance of CRC-32C per 64 MiB piece (see [Note: checkpoint
    checksum]); this checks the implementation, and that the patterns which fooled ``sum64``
    (two sign-bit flips in words of the same parity) are caught.
    """
    data = bytearray(random.Random(0).randbytes(96))
    good = crc32c_reference(bytes(data))
    nbits = 8 * len(data)

    def flipped(bits: tuple[int, ...]) -> list[int]:
        for b in bits:
            data[b // 8] ^= 1 << (b % 8)
        out = crc32c_reference(bytes(data))
        for b in bits:
            data[b // 8] ^= 1 << (b % 8)
        return out

    assert all(flipped((b,)) != good for b in range(nbits))
    assert all(flipped(p) != good for p in itertools.combinations(range(nbits), 2))
    rng = random.Random(1)
    assert all(flipped(tuple(rng.sample(range(nbits), 3))) != good for _ in range(30_000))
    good_sum64 = sum64_reference(bytes(data))
    for i in range(0, len(data) // 8 - 2):  # the sign bits of words i and i + 2
        blind = (64 * i + 63, 64 * (i + 2) + 63)
        for b in blind:
            data[b // 8] ^= 1 << (b % 8)
        assert sum64_reference(bytes(data)) == good_sum64  # what the old checksum missed
        for b in blind:
            data[b // 8] ^= 1 << (b % 8)
        assert flipped(blind) != good


def test_sum64_missed_what_crc32c_catches(tmp_path):
    """The concrete failure of issue 25: two sign-bit flips pass sum64, fail crc32c in both verifiers."""
    path = str(tmp_path / "w.safetensors")
    rec = write_tensor_file(path, [TensorEntry("w", (256,), torch.float32, lambda: torch.randn(256))])
    data = bytearray(open(path, "rb").read())
    old = {"bytes": len(data), "sum64": sum64_reference(bytes(data))}
    i = len(data) // 16
    data[8 * i + 7] ^= 0x80
    data[8 * (i + 2) + 7] ^= 0x80
    open(path, "wb").write(bytes(data))
    assert sum64_reference(bytes(data)) == old["sum64"]  # the old checksum is blind to it
    for verify in (verify_file, _script()._verify):
        with pytest.raises(Exception, match=r"w\.safetensors fails its checksum \(crc32c"):
            verify(path, rec)
    c = FileChecksum(path, dict(rec, crc32c=crc32c_reference(bytes(data), 100), crc32c_chunk=100))
    c.update(bytes(data))
    c.check()  # a record with another piece size verifies by that size


def _two_tensor_file(path: str) -> None:
    write_tensor_file(
        path,
        [
            TensorEntry("a", (4,), torch.float32, lambda: torch.arange(4.0)),
            TensorEntry("b", (2, 3), torch.float32, lambda: torch.ones(2, 3)),
        ],
    )


def _forge(path: str, edit) -> None:
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = edit(header, data[8 + n :])
    raw = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(raw)) + raw + body)


def _set(name, key, value):
    def edit(h, body):
        h[name][key] = value
        return body

    return edit


# kind -> (edit, what both readers' errors must say)
FORGERIES = {
    "overlap": (
        _set("b", "data_offsets", [8, 32]),
        "tensor 'b' at bytes [8, 32) overlaps the previous tensor",
    ),
    "gap": (
        lambda h, body: (h["b"].update(data_offsets=[20, 44]), body + b"\0" * 4)[1],
        "tensor 'b' at bytes [20, 44) leaves a gap after byte 16",
    ),
    "out of bounds": (_set("b", "data_offsets", [16, 48]), "tensor 'b' spans bytes [16, 48) but its dtype"),
    "trailing bytes": (lambda h, body: body + b"\0" * 8, "end at byte 40 of a 48-byte data section"),
    "dtype vs span": (
        _set("a", "dtype", "F64"),
        "tensor 'a' spans bytes [0, 16) but its dtype and shape need 32",
    ),
    "shape vs span": (
        _set("b", "shape", [3, 3]),
        "tensor 'b' spans bytes [16, 40) but its dtype and shape need 36",
    ),
    "bool offset": (_set("a", "data_offsets", [False, 16]), "'a'"),
}


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_forged_headers_are_rejected_by_both_readers(tmp_path, kind):
    edit, says = FORGERIES[kind]
    path = str(tmp_path / "f.safetensors")
    _two_tensor_file(path)
    TensorFile(path).close()  # the honest file is fine
    _forge(path, edit)
    with pytest.raises(CheckpointError, match=r"f\.safetensors is not a valid safetensors tensor file") as e1:
        TensorFile(path)
    with pytest.raises(Exception, match=r"f\.safetensors is not a valid safetensors tensor file") as e2:
        _script()._RankFile(path)
    assert says in str(e1.value) and says in str(e2.value), (str(e1.value), str(e2.value))


def test_duplicate_tensor_names_are_rejected(tmp_path):
    path = str(tmp_path / "f.safetensors")
    _two_tensor_file(path)
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + n]
    forged = raw[:-1] + b',"a":' + json.dumps(json.loads(raw)["a"]).encode() + b"}"
    open(path, "wb").write(struct.pack("<Q", len(forged)) + forged + data[8 + n :])
    with pytest.raises(CheckpointError, match="tensor 'a' appears twice"):
        TensorFile(path)
    with pytest.raises(Exception, match="appears twice|a key appears twice"):
        _script()._RankFile(path)


def _meta() -> dict:
    return {
        "format_version": 3,
        "world_size": 2,
        "zero_stage": 1,
        "global_steps": 5,
        "global_samples": 10,
        "skipped_steps": 1,
        "micro_steps": 5,
        "loss_scaler": {"cur_scale": 65536.0, "cur_iter": 5, "last_overflow_iter": -1},
        "optimizer": {
            "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}]
        },
        "lr_scheduler": None,
        "client_state": {"x": float("inf")},
        "files": {},
    }


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(world_size=0), "world_size is 0"),
        (lambda m: m.update(zero_stage=4), "zero_stage is 4"),
        (lambda m: m.update(global_steps=-1), "global_steps is -1"),
        (lambda m: m.update(skipped_steps=9), "skipped_steps is 9"),
        (lambda m: m["loss_scaler"].update(cur_scale=-2.0), "cur_scale is -2.0"),
        (lambda m: m["loss_scaler"].update(cur_scale=float("nan")), "cur_scale is nan"),
        (
            lambda m: m["optimizer"]["param_groups"][0].update(lr=float("inf")),
            r"param_groups\[0\]\.lr is inf",
        ),
        (lambda m: m["optimizer"]["param_groups"][0].update(betas=[1.5, 0.9]), "betas"),
        (lambda m: m["optimizer"]["param_groups"][0].update(eps=0.0), "eps is 0.0"),
        (lambda m: m.update(global_steps="5"), "global_steps is '5'"),
    ],
)
def test_root_record_is_sealed_and_range_checked(tmp_path, edit, message):
    path = str(tmp_path / "checkpoint.json")
    meta = _meta()
    open(path, "wb").write(sealed_bytes(meta))
    assert read_sealed(path, required=True) == {**meta, "seal": read_sealed(path, required=True)["seal"]}
    check_engine_meta(meta, path)
    sealed = json.loads(open(path).read())
    sealed["global_steps"] = 6  # a hand edit that keeps the old seal
    open(path, "w").write(json.dumps(sealed))
    with pytest.raises(CheckpointError, match=r"checkpoint\.json fails its checksum \(seal\)"):
        read_sealed(path, required=True)
    edit(meta)  # resealed by someone who recomputes it: the range checks still hold
    open(path, "wb").write(sealed_bytes(meta))
    with pytest.raises(CheckpointError, match=message):
        check_engine_meta(read_sealed(path, required=True), path)


def test_full_disk_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    def full(f, view):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic, "_write_all", full)
    path = str(tmp_path / "rank_00000.safetensors")
    with pytest.raises(
        OSError, match=r"No space left on device while writing checkpoint file.*rank_00000"
    ) as e:
        write_tensor_file(path, [TensorEntry("w", (3,), torch.float32, lambda: torch.ones(3))])
    assert e.value.errno == errno.ENOSPC and e.value.filename == path
    assert os.listdir(tmp_path) == []
    assert file_record(3, crc32c=[1])["crc32c_chunk"] == 2**26


def test_a_rejected_file_never_closes_another_files_descriptor(tmp_path):
    """A TensorFile whose header is refused must not close its fd number again when collected.

    That number is reused by the next open; closing it again (as ``__del__`` did after a failed
    open) broke an unrelated reader later ("Bad file descriptor" in zero_to_fp32).
    """
    import gc

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 8) + b"not json")
    with pytest.raises(CheckpointError, match="not JSON") as info:
        TensorFile(str(bad))
    fd = os.open(str(bad), os.O_RDONLY)  # typically the number the refused file had
    try:
        del info
        gc.collect()  # the refused TensorFile is collected here
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
