"""The fast I/O paths of checkpoints: overlapped checksums, crc32c (sum64 for old checkpoints), reading into place.

See [Note: checksum overlapped with writing] (atomic.py), [Note: checkpoint checksum]
(integrity.py) and [Note: reading into place] (fragments.py).
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch
from zero_core.checkpoint import CheckpointError
from zero_core.checkpoint.atomic import AtomicWriter
from zero_core.checkpoint.fragments import CheckpointReader
from zero_core.checkpoint.integrity import (
    Sum64,
    crc32c_reference,
    file_checksum,
    file_crc32c,
    file_record,
    file_sum64,
    sum64_reference,
    verify_file,
)
from zero_core.checkpoint.tensor_file import TensorEntry, TensorFile, write_tensor_file


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4096 + 3, 8 * 2**17 + 13])
def test_sum64_streaming_matches_its_definition_for_any_split(n):
    rng = random.Random(n)
    data = bytes(rng.getrandbits(8) for _ in range(n))
    s = Sum64()
    i = 0
    while i < n:
        k = rng.randint(1, 70_000)
        s.update(memoryview(data)[i : i + k])  # unaligned pieces and addresses
        i += k
    assert s.hexdigest() == sum64_reference(data)


def test_sum64_detects_bit_flips_and_swapped_words():
    data = bytearray(os.urandom(8 * 1000))
    ref = sum64_reference(bytes(data))
    for pos in (0, 7, 4000, len(data) - 1):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        assert sum64_reference(bytes(flipped)) != ref
    swapped = bytearray(data)
    swapped[0:8], swapped[8:16] = data[8:16], data[0:8]
    assert sum64_reference(bytes(swapped)) != ref


def test_deferred_checksums_equal_inline_ones(tmp_path):
    rng = torch.Generator().manual_seed(0)
    bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=rng) for n in (13, 5000, 1 << 20, 3)]
    paths = []
    for defer in (False, True):
        path = str(tmp_path / f"f{defer}")
        with AtomicWriter(path, defer_checksum=defer, sum64=True, crc32c=True) as w:
            for i, b in enumerate(bufs):
                # a mix of stable (deferred) and unstable (inline, after catching up) buffers
                w.write(memoryview(b.numpy()), stable=i % 2 == 0)
        paths.append((w.crc32, w.sum64, w.crc32c, w.nbytes))
        assert (w.nbytes, w.crc32) == file_checksum(path)
        assert (w.nbytes, w.sum64) == file_sum64(path)
        assert (w.nbytes, w.crc32c) == file_crc32c(path)
        assert w.crc32c == crc32c_reference(open(path, "rb").read())
    assert paths[0] == paths[1]
    assert not any(p.name.startswith("fTrue.tmp") for p in tmp_path.iterdir())


def test_live_tensor_file_record_matches_the_file(tmp_path):
    ts = [torch.randn(1000), torch.randn(3, 7).to(torch.bfloat16), torch.arange(5)]
    entries = [TensorEntry(f"t{i}", tuple(t.shape), t.dtype, (lambda t=t: t)) for i, t in enumerate(ts)]
    path = str(tmp_path / "x.safetensors")
    rec = write_tensor_file(path, entries, live_tensors=True)
    n, crcs = file_crc32c(path)
    assert (
        rec
        == file_record(n, crc32c=crcs)
        == {"bytes": os.path.getsize(path), "crc32c": crcs, "crc32c_chunk": 2**26}
    )
    verify_file(path, rec)
    with TensorFile(path) as f:
        for i, t in enumerate(ts):
            assert torch.equal(f.read_tensor(f"t{i}"), t)


def _load_script():
    """The standalone conversion script, imported from its file as a checkpoint copy would be."""
    import importlib.util

    import zero_core.checkpoint.zero_to_fp32 as mod

    spec = importlib.util.spec_from_file_location("standalone_zero_to_fp32", mod.__file__)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_verify_uses_crc32c_and_still_verifies_old_records(tmp_path):
    script = _load_script()
    path = str(tmp_path / "x.safetensors")
    rec = write_tensor_file(path, [TensorEntry("w", (4099,), torch.float32, lambda: torch.randn(4099))])
    assert set(rec) == {"bytes", "crc32c", "crc32c_chunk"}
    sum64_style = file_record(*file_sum64(path)[:1], sum64=file_sum64(path)[1])  # format 2
    crc32_style = file_record(*file_checksum(path))  # format 1
    for check in (verify_file, script._verify):
        for r in (rec, sum64_style, crc32_style):
            check(path, r)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    for check in (verify_file, script._verify):
        with pytest.raises(Exception, match=r"x\.safetensors fails its checksum \(crc32c"):
            check(path, rec)
        with pytest.raises(Exception, match=r"x\.safetensors fails its checksum \(sum64"):
            check(path, sum64_style)
        with pytest.raises(Exception, match=r"x\.safetensors fails its checksum \(crc32 "):
            check(path, crc32_style)
        with pytest.raises(Exception, match=r"record of checkpoint file .*x\.safetensors has no checksum"):
            check(path, {"bytes": len(data)})
        with pytest.raises(Exception, match=r"crc32c_chunk"):
            check(path, dict(rec, crc32c_chunk=2**31))
    assert zlib.crc32(bytes(data)) != crc32_style["crc32"]


def _two_rank_reader(tmp_path) -> tuple[CheckpointReader, torch.Tensor]:
    """A (10, 30) fp32 value split over two rank files at element 123."""
    full = torch.randn(10, 30)
    flat = full.reshape(-1)
    tables = []
    for r, (lo, hi) in enumerate([(0, 123), (123, 300)]):
        key = f"fp32:w:{lo}"
        name = f"rank_{r:05d}.safetensors"
        piece = flat[lo:hi].clone()
        rec = write_tensor_file(
            str(tmp_path / name), [TensorEntry(key, (hi - lo,), torch.float32, lambda p=piece: p)]
        )
        frag = {"name": "w", "kind": "fp32", "shape": [10, 30], "dtype": "float32", "start": lo, "end": hi}
        frag |= {"key": key, "elementwise": True, "python_scalar": False}
        tables.append({"file": name, "file_record": rec, "fragments": [frag]})
    return CheckpointReader(str(tmp_path), tables), full


def test_read_into_fills_place_across_rank_files(tmp_path):
    reader, full = _two_rank_reader(tmp_path)
    flat = full.reshape(-1)
    for lo, hi in [(0, 300), (100, 150), (123, 124), (0, 123), (299, 300), (5, 5)]:
        out = torch.full((hi - lo,), float("nan"))
        reader.read_into(out, "w", "fp32", lo)
        assert torch.equal(out, flat[lo:hi])
        assert torch.equal(reader.read("w", "fp32", lo, hi), flat[lo:hi])
    whole = torch.empty(10, 30)
    reader.read_fp32_into(whole, "w")
    assert torch.equal(whole, full)
    # a non-contiguous or other-dtype destination takes the converting fallback
    t = torch.zeros(30, 10).t()
    reader.read_module_value_into(t, "w")
    assert torch.equal(t, full)
    half = torch.zeros(300, dtype=torch.float16)
    reader.read_module_value_into(half, "w")
    assert torch.equal(half, flat.half())
    with pytest.raises(CheckpointError, match=r"range \[290, 301\) is outside fp32:w of 300"):
        reader.read_into(torch.empty(11), "w", "fp32", 290)
    with pytest.raises(TypeError, match="out must be a tensor"):
        reader.read_into([0.0], "w", "fp32")
    reader.close()


def test_tensor_file_read_into_validates_the_destination(tmp_path):
    path = str(tmp_path / "x.safetensors")
    write_tensor_file(path, [TensorEntry("w", (8,), torch.float32, lambda: torch.arange(8.0))])
    with TensorFile(path) as f:
        out = torch.empty(3)
        f.read_into(out, "w", 4)
        assert out.tolist() == [4.0, 5.0, 6.0]
        with pytest.raises(CheckpointError, match=r"cannot read 'w' \(torch.float32\) into a torch.float64"):
            f.read_into(torch.empty(3, dtype=torch.float64), "w")
        with pytest.raises(CheckpointError, match=r"range \[6, 9\) is outside tensor 'w'"):
            f.read_into(torch.empty(3), "w", 6)
