"""Single-pass loads: each tensor file read once, into place and into its checksum together.

See [Note: single-pass load] (checkpoint/single_pass.py) and [Note: shared verification]
(checkpoint/loader.py): incremental checksums equal whole-file ones, the pass fills every
request and reads the file front to back once, and a load that fails after overwriting part
of the state leaves the engine refusing to train or save until a good load.
"""

from __future__ import annotations

import hashlib
import os
import random
import zlib

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not ~4 s in every forked rank)
import torch.nn as nn
import zero_core.engine  # noqa: F401
from zero_core.checkpoint import single_pass
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.integrity import FileChecksum, file_checksum, file_sum64, sum64_reference
from zero_core.checkpoint.single_pass import (
    files_verified_by,
    read_file_once,
    read_files_once,
    read_ranges,
    verifier_of,
)
from zero_core.testing import run_multirank

# -- incremental checksums ----------------------------------------------------------------


def _random_split(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 12)))) if data else []
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("algorithm", ["sum64", "crc32"])
def test_incremental_checksum_equals_the_whole_file(tmp_path, seed, algorithm):
    rng = random.Random(seed)
    data = rng.randbytes(rng.choice([0, 1, 7, 8, 9, 1000, 3 * 2**17 + 5]))
    path = tmp_path / "f"
    path.write_bytes(data)
    if algorithm == "sum64":
        n, digest = file_sum64(str(path))
        assert digest == sum64_reference(data)
        record: dict = {"bytes": n, "sum64": digest}
    else:
        n, crc = file_checksum(str(path))
        assert crc == zlib.crc32(data)
        record = {"bytes": n, "crc32": crc}
    for _ in range(5):
        c = FileChecksum(str(path), record)
        for piece in _random_split(data, rng):
            c.update(memoryview(piece))
        c.check()  # the same value whatever the piece boundaries
    if data:
        flipped = bytearray(data)
        flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        c = FileChecksum(str(path), record)
        for piece in _random_split(bytes(flipped), rng):
            c.update(piece)
        with pytest.raises(CheckpointError, match=r"/f fails its checksum"):
            c.check()
    c = FileChecksum(str(path), record)
    c.update(data + b"x")
    with pytest.raises(CheckpointError, match=r"/f has \d+ bytes.*truncated"):
        c.check()


def test_a_record_without_checksum_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="has no checksum"):
        FileChecksum(str(tmp_path / "f"), {"bytes": 3})


# -- one pass over a file -----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_the_pass_fills_every_request_reading_the_file_once_in_order(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(single_pass, "_PIECE", 64)  # many pieces, the scratch buffer reused
    rng = random.Random(seed)
    data = rng.randbytes(64 * 30 + rng.randrange(64))
    path = tmp_path / "f"
    path.write_bytes(data)
    record = {"bytes": len(data), "sum64": sum64_reference(data)}
    requests = []
    for _ in range(8):  # random ranges, some overlapping, in random order
        lo = rng.randrange(len(data))
        hi = rng.randrange(lo, min(len(data), lo + 400) + 1)
        requests.append((lo, bytearray(hi - lo)))
    reads = []
    real = os.preadv

    def preadv(fd, bufs, offset):
        k = real(fd, bufs, offset)
        reads.append((offset, offset + k))
        return k

    monkeypatch.setattr(single_pass.os, "preadv", preadv)
    read_file_once(str(path), record, [(lo, memoryview(buf)) for lo, buf in requests])
    for lo, buf in requests:
        assert bytes(buf) == data[lo : lo + len(buf)]
    # front to back: each read starts where the previous one ended, except re-reads of overlaps
    pos = 0
    for lo, hi in reads:
        if lo == pos:
            pos = hi
        else:
            assert hi <= pos, (lo, hi, pos)  # a second request over bytes already read
    assert pos == len(data)


def test_the_pass_names_a_corrupted_or_truncated_file(tmp_path):
    data = os.urandom(5000)
    path = tmp_path / "rank_00003.safetensors"
    path.write_bytes(data)
    good = {"bytes": len(data), "sum64": sum64_reference(data)}
    out = bytearray(100)
    read_file_once(str(path), good, [(10, memoryview(out))])
    assert bytes(out) == data[10:110]
    bad = dict(good, sum64="0" * 32)
    with pytest.raises(CheckpointError, match=r"rank_00003\.safetensors fails its checksum"):
        read_file_once(str(path), bad, [(10, memoryview(out))])
    os.truncate(path, 4000)
    with pytest.raises(CheckpointError, match=r"rank_00003\.safetensors has 4000 bytes.*truncated"):
        read_file_once(str(path), good, [])
    old = {"bytes": 4000, "crc32": zlib.crc32(data[:4000])}  # checkpoints from before sum64
    read_file_once(str(path), old, [(3990, memoryview(out)[:10])])
    assert bytes(out[:10]) == data[3990:4000]
    with pytest.raises(CheckpointError, match=r"requested, the file has 4000 bytes"):
        read_file_once(str(path), old, [(3990, memoryview(out))])


def test_ranges_are_read_straight_into_place_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setattr(single_pass, "_RANGE_PIECE", 64)
    data = os.urandom(10_000)
    path = tmp_path / "rank_00001.safetensors"
    path.write_bytes(data)
    record = {"bytes": len(data), "sum64": "0" * 32}  # not checked: another rank verifies this file
    bufs = [(9000, bytearray(500)), (100, bytearray(300)), (250, bytearray(200)), (5000, bytearray(0))]
    read = []
    real = os.preadv

    def preadv(fd, views, offset):
        k = real(fd, views, offset)
        read.extend(range(offset, offset + k))
        return k

    monkeypatch.setattr(single_pass.os, "preadv", preadv)
    read_ranges(str(path), record, [(off, memoryview(b)) for off, b in bufs])
    for off, b in bufs:
        assert bytes(b) == data[off : off + len(b)]
    wanted = set(range(100, 450)) | set(range(9000, 9500))
    assert set(read) == wanted and len(read) == len(wanted) + 150  # only [250, 400) is read twice
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors: bytes \[9900, 10400\) requested"):
        read_ranges(str(path), record, [(9900, memoryview(bytearray(500)))])
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors has 10000 bytes.*truncated"):
        read_ranges(str(path), dict(record, bytes=10_001), [])


# -- who verifies which file ---------------------------------------------------------------


@pytest.mark.parametrize("saved", range(1, 6))
@pytest.mark.parametrize("loading", range(1, 6))
def test_every_file_has_exactly_one_verifier(saved, loading):
    owners = {
        f: [r for r in range(loading) if f in files_verified_by(r, saved, loading)] for f in range(saved)
    }
    assert owners == {f: [verifier_of(f, loading)] for f in range(saved)}
    assert sorted(f for r in range(loading) for f in files_verified_by(r, saved, loading)) == list(
        range(saved)
    )
    counts = [len(files_verified_by(r, saved, loading)) for r in range(loading)]
    assert max(counts) - min(counts) <= 1  # the work is spread evenly
    if saved == loading:
        assert all(verifier_of(f, loading) == f for f in range(saved))  # each rank its own file
    if loading > saved:
        assert counts[saved:] == [0] * (loading - saved)


def test_the_verifier_functions_refuse_bad_arguments():
    for args in [(-1, 2), (0, 0), (1.0, 2), (True, 2)]:
        with pytest.raises(ValueError, match="verifier_of"):
            verifier_of(*args)
    for args in [(2, 3, 2), (-1, 3, 2), (0, -1, 2), (0, 3, 0)]:
        with pytest.raises(ValueError, match="files_verified_by"):
            files_verified_by(*args)


def test_one_process_verifies_every_file_even_those_it_does_not_read(tmp_path):
    tables = []
    datas = [os.urandom(3000), os.urandom(2000)]
    for r, data in enumerate(datas):
        (tmp_path / f"rank_{r:05d}.safetensors").write_bytes(data)
        rec = {"bytes": len(data), "sum64": sum64_reference(data)}
        tables.append({"file": f"rank_{r:05d}.safetensors", "file_record": rec})
    out = bytearray(10)
    plan = {0: [(5, memoryview(out))]}  # only file 0 is touched
    verified: set[int] = set()
    read_files_once(str(tmp_path), tables, plan, verified)
    assert bytes(out) == datas[0][5:15] and verified == {0, 1} and plan == {0: []}
    with open(tmp_path / "rank_00001.safetensors", "r+b") as f:
        f.write(bytes([datas[1][0] ^ 1]))
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors fails its checksum"):
        read_files_once(str(tmp_path), tables, {0: [(5, memoryview(out))]}, set())


# -- engine loads that fail after overwriting part of the state ---------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 200)
        self.l2 = nn.Linear(200, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x))).pow(2).mean()


def _engine(stage: int, seed: int):
    import zero_core

    torch.manual_seed(seed)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zero_core.initialize(model=Net(), config=cfg)
    return engine


def _train(engine, first: int, last: int) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = engine(torch.randn(2, 6, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _load_error(engine, tmp: str, tag: str) -> str:
    """The CheckpointError message of loading ``tag``, or "loaded" when the load succeeds."""
    try:
        engine.load_checkpoint(tmp, tag=tag)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def _refusals(engine, tmp: str) -> list[str]:
    """The error of each training or saving call (every one must refuse)."""
    out = []
    calls = {
        "forward": lambda: engine(torch.randn(2, 6)),
        "backward": lambda: engine.backward(torch.ones((), requires_grad=True)),
        "step": engine.step,
        "save_checkpoint": lambda: engine.save_checkpoint(tmp, tag="after_failed_load"),
    }
    for name, call in calls.items():
        try:
            call()
        except RuntimeError as e:
            out.append(str(e))
        else:
            out.append(f"{name} ran")
    return out


def _weights(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _save_good_and_bad(tmp: str, stage: int) -> None:
    engine = _engine(stage, seed=0)
    _train(engine, 0, 3)
    engine.save_checkpoint(tmp, tag="good")
    _train(engine, 3, 5)
    engine.save_checkpoint(tmp, tag="bad")


def _corrupt(path: str) -> str:
    with open(path, "r+b") as f:  # a bit flipped in the last tensor (optimizer state)
        f.seek(os.path.getsize(path) - 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _fail_then_recover(tmp: str, stage: int) -> dict:
    import torch.distributed as dist

    _save_good_and_bad(tmp, stage)
    bad_file = os.path.join(tmp, "bad", "rank_00001.safetensors")
    if dist.get_rank() == 0:
        _corrupt(bad_file)
    dist.barrier()
    digest = hashlib.sha256(open(bad_file, "rb").read()).hexdigest()
    engine = _engine(stage, seed=1)
    error = _load_error(engine, tmp, "bad")
    refusals = _refusals(engine, tmp)
    unchanged = hashlib.sha256(open(bad_file, "rb").read()).hexdigest() == digest
    engine.load_checkpoint(tmp, tag="good")
    recovered = _train(engine, 3, 6)
    fresh = _engine(stage, seed=2)
    fresh.load_checkpoint(tmp, tag="good")
    expected = _train(fresh, 3, 6)
    same_weights = all(torch.equal(a, b) for a, b in zip(_weights(engine), _weights(fresh)))
    return {
        "error": error,
        "refusals": refusals,
        "unchanged": unchanged,
        "exact": recovered == expected and same_weights,
        "nothing_saved": not os.path.exists(os.path.join(tmp, "after_failed_load")),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_a_corrupted_file_leaves_the_engine_refusing_until_a_good_load(tmp_path, stage):
    r0, r1 = run_multirank(_fail_then_recover, 2, args=(str(tmp_path), stage))
    # rank 1 verifies rank_00001 (its own file); rank 0 reads at most its ranges of it (stage 2: the
    # module weights), unverified, and names the file its verifier found bad
    assert "rank_00001.safetensors fails its checksum" in r1["error"], r1["error"]
    assert "rank_00001.safetensors failed verification on another rank" in r0["error"], r0["error"]
    for r in (r0, r1):
        assert len(r["refusals"]) == 4
        for name, msg in zip(["forward", "backward", "step", "save_checkpoint"], r["refusals"]):
            assert msg.startswith(f"engine.{name}: the last load_checkpoint from "), msg
            assert "/bad failed after overwriting part of the model/optimizer state" in msg, msg
            assert "rank_00001.safetensors" in msg and "load a good checkpoint before training" in msg, msg
        assert r["unchanged"], "the load modified the checkpoint on disk"
        assert r["nothing_saved"], "save_checkpoint wrote a checkpoint of an invalid state"
        assert r["exact"], "training after the good load differs from a fresh engine loading it"


def _truncated_before_and_during(tmp: str) -> dict:
    """World 1 loading a 2-rank stage-2 checkpoint: reads rank_00000, then rank_00001."""
    out = {}
    bad = os.path.join(tmp, "bad", "rank_00001.safetensors")
    size = os.path.getsize(bad)
    os.truncate(bad, size - 64)  # before the load: found by the size check, nothing touched
    engine = _engine(2, seed=1)
    before = _weights(engine)
    try:
        engine.load_checkpoint(tmp, tag="bad")
    except CheckpointError as e:
        out["before"] = str(e)
    out["before_untouched"] = all(torch.equal(a, b) for a, b in zip(before, _weights(engine)))
    _train(engine, 0, 1)  # the state is intact: training may go on
    with open(bad, "r+b") as f:
        f.truncate(size)  # the size matches again; the file is still not the one saved

    real = single_pass.read_file_once

    def truncate_first(path, record, requests):
        if path.endswith("rank_00001.safetensors"):
            os.truncate(path, size - 64)  # cut while the load is already copying
        return real(path, record, requests)

    single_pass.read_file_once = truncate_first
    try:
        engine.load_checkpoint(tmp, tag="bad")
    except CheckpointError as e:
        out["during"] = str(e)
    finally:
        single_pass.read_file_once = real
    out["refusals"] = _refusals(engine, tmp)
    engine.load_checkpoint(tmp, tag="good")
    fresh = _engine(2, seed=2)
    fresh.load_checkpoint(tmp, tag="good")
    out["exact"] = _train(engine, 3, 5) == _train(fresh, 3, 5) and all(
        torch.equal(a, b) for a, b in zip(_weights(engine), _weights(fresh))
    )
    return out


def test_a_truncated_file_is_named_and_refused_if_found_after_copying(tmp_path):
    run_multirank(_save_good_and_bad, 2, args=(str(tmp_path), 2))
    (r,) = run_multirank(_truncated_before_and_during, 1, args=(str(tmp_path),))
    assert "rank_00001.safetensors has" in r["before"] and "truncated" in r["before"], r["before"]
    assert r["before_untouched"]
    assert "rank_00001.safetensors has" in r["during"] and "truncated" in r["during"], r["during"]
    for msg in r["refusals"]:
        assert "failed after overwriting part of the model/optimizer state" in msg, msg
    assert r["exact"]


def _spans_minus(spans: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``spans`` outside every span of ``cut``."""
    out = []
    for lo, hi in spans:
        pieces = [(lo, hi)]
        for clo, chi in cut:
            pieces = [p for a, b in pieces for p in ((a, min(b, clo)), (max(a, chi), b)) if p[0] < p[1]]
        out += pieces
    return out


def _corruption_only_a_non_verifier_copies(tmp: str, stage: int, file_rank: int) -> dict:
    """World 2 loading ``tmp``'s 'bad' tag with one bit flipped where the non-verifying rank copies from it.

    A first load (of the intact tag, into a throwaway engine) records the byte ranges each rank
    reads from rank file ``file_rank``; rank 0 then flips a bit in the middle of the largest
    range the non-verifier copies, outside the verifier's requests where there is such a range.
    """
    import torch.distributed as dist

    name = f"rank_{file_rank:05d}.safetensors"
    calls: list[tuple[str, str, list[tuple[int, int]]]] = []
    real = {f: getattr(single_pass, f) for f in ("read_file_once", "read_ranges")}

    def recorder(fn):
        def call(path, record, requests):
            requests = list(requests)
            spans = [(off, off + len(memoryview(d).cast("B"))) for off, d in requests]
            calls.append((fn, os.path.basename(path), spans))
            return real[fn](path, record, requests)

        return call

    for fn in real:
        setattr(single_pass, fn, recorder(fn))
    try:
        _engine(stage, seed=3).load_checkpoint(tmp, tag="bad")
        everyone: list = [None, None]
        dist.all_gather_object(everyone, list(calls))
        verifier = verifier_of(file_rank, 2)
        other = 1 - verifier
        copied = [s for fn, f, spans in everyone[other] if f == name and fn == "read_ranges" for s in spans]
        by_verifier = [s for fn, f, spans in everyone[verifier] if f == name for s in spans]
        only = _spans_minus(copied, by_verifier)
        lo, hi = max(only or copied or [(0, 0)], key=lambda s: s[1] - s[0])
        offset = (lo + hi) // 2
        path = os.path.join(tmp, "bad", name)
        if dist.get_rank() == 0 and hi > lo:
            with open(path, "r+b") as f:
                f.seek(offset)
                b = f.read(1)
                f.seek(offset)
                f.write(bytes([b[0] ^ 0x04]))
        dist.barrier()
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
        calls.clear()
        engine = _engine(stage, seed=1)
        error = _load_error(engine, tmp, "bad")
        bad_load = list(calls)
    finally:
        for fn, f in real.items():
            setattr(single_pass, fn, f)
    refusals = _refusals(engine, tmp)
    engine.load_checkpoint(tmp, tag="good")
    recovered = _train(engine, 3, 6)
    fresh = _engine(stage, seed=2)
    fresh.load_checkpoint(tmp, tag="good")
    expected = _train(fresh, 3, 6)
    return {
        "rank": dist.get_rank(),
        "verifier": verifier,
        "offset": offset if hi > lo else None,
        "only_non_verifier": bool(only),
        # this load: how this rank read the corrupted byte (None: not at all)
        "read_bad_byte_by": next(
            (fn for fn, f, spans in bad_load if f == name and any(a <= offset < b for a, b in spans)), None
        ),
        "verified_whole": any(fn == "read_file_once" and f == name for fn, f, _ in bad_load),
        "error": error,
        "refusals": refusals,
        "unchanged": hashlib.sha256(open(path, "rb").read()).hexdigest() == digest,
        "exact": recovered == expected
        and all(torch.equal(a, b) for a, b in zip(_weights(engine), _weights(fresh))),
    }


@pytest.mark.parametrize(
    ("saved_world", "file_rank"),
    [
        (2, 0),  # both ranks read both files: rank 1 copies module weights from rank 0's file unverified
        (1, 0),  # 1 -> 2 ranks: rank 1 verifies nothing, and alone copies the second half's optimizer state
    ],
)
def test_corruption_copied_only_by_a_non_verifying_rank_fails_every_rank(tmp_path, saved_world, file_rank):
    run_multirank(_save_good_and_bad, saved_world, args=(str(tmp_path), 2))
    results = run_multirank(_corruption_only_a_non_verifier_copies, 2, args=(str(tmp_path), 2, file_rank))
    name = f"rank_{file_rank:05d}.safetensors"
    verifier = verifier_of(file_rank, 2)
    v, nv = results[verifier], results[1 - verifier]
    assert v["offset"] is not None and v["offset"] == nv["offset"], "the non-verifier copied nothing"
    # the premise: the verifier reads the file whole and checksums it, the other rank copies the bad
    # byte into place without checksumming it
    assert v["verified_whole"], v
    if saved_world == 1:  # the verifier does not request that byte: it goes to scratch and its checksum
        assert v["only_non_verifier"] and v["read_bad_byte_by"] is None, v
    else:  # the verifier copies it too (module weights)
        assert v["read_bad_byte_by"] == "read_file_once", v
    assert not nv["verified_whole"] and nv["read_bad_byte_by"] == "read_ranges", nv
    assert f"{name} fails its checksum" in v["error"], v["error"]
    assert f"{name} failed verification on another rank" in nv["error"], nv["error"]
    for r in results:
        assert len(r["refusals"]) == 4
        for call, msg in zip(["forward", "backward", "step", "save_checkpoint"], r["refusals"]):
            assert msg.startswith(f"engine.{call}: the last load_checkpoint from "), msg
            assert name in msg and "load a good checkpoint before training" in msg, msg
        assert r["unchanged"], "the load modified the checkpoint on disk"
        assert r["exact"], "training after the good load differs from a fresh engine loading it"
