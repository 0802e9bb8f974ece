"""Crash safety, corruption detection and no-unpickling of checkpoints."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not ~4 s in every forked rank)
import torch.nn as nn
import zero_core.engine  # noqa: F401
from zero_core.testing import RankFailedError, run_multirank


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 300)
        self.l2 = nn.Linear(300, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x))).pow(2).mean()


def _engine(stage: int = 1):
    import zero_core

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zero_core.initialize(model=Net(), config=cfg)
    return engine


def _step(engine) -> None:
    engine.backward(engine(torch.randn(2, 5)))
    engine.step()


def _save_then_die(tmp: str) -> None:
    import torch.distributed as dist
    from zero_core.checkpoint import atomic

    engine = _engine()
    _step(engine)
    engine.save_checkpoint(tmp, tag="good")
    _step(engine)
    if dist.get_rank() == 1:
        atomic._written_total = 0
        os.environ["ZERO_CHECKPOINT_KILL_AFTER_BYTES"] = "4000"  # mid-way through its tensor file
    engine.save_checkpoint(tmp, tag="bad")


def _good_state(tmp: str) -> dict:
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(tmp)


def test_rank_killed_mid_write_leaves_previous_tag(tmp_path):
    tmp = str(tmp_path)
    with pytest.raises(RankFailedError) as info:
        run_multirank(_save_then_die, 2, args=(tmp,), timeout=60)
    assert 1 in info.value.failed_ranks
    assert "rank 1 exited with signal SIGKILL" in str(info.value)
    with open(tmp_path / "latest") as f:
        assert f.read() == "good"
    assert not (tmp_path / "bad").exists()
    # the killed rank left a partial temporary file behind in the staging directory, never a final name
    staged = os.listdir(tmp_path / ".bad.partial")
    assert any(".tmp." in n for n in staged) and "rank_00001.safetensors" not in staged
    state = _good_state(tmp)
    assert set(state) == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}

    def _load_good() -> int:
        engine = _engine(2)
        path, _ = engine.load_checkpoint(tmp)
        assert path.endswith("good")
        return engine.global_steps

    assert run_multirank(_load_good, 2) == [1, 1]


def _overwrite_then_die(tmp: str) -> None:
    import torch.distributed as dist

    engine = _engine()
    _step(engine)
    engine.save_checkpoint(tmp, tag="t")
    _step(engine)
    if (
        dist.get_rank() == 0
    ):  # rank 0 commits: killed after moving the old tag aside, before the new one lands
        os.environ["ZERO_CHECKPOINT_KILL_AT"] = "between_renames"
    engine.save_checkpoint(tmp, tag="t")


def _load_then_overwrite(tmp: str) -> tuple[int, int]:
    engine = _engine(2)
    with pytest.warns(UserWarning, match="interrupted"):
        path, _ = engine.load_checkpoint(tmp)
    loaded = engine.global_steps
    assert path.endswith(".t.old")
    _step(engine)
    engine.save_checkpoint(tmp, tag="t")  # the next save of the tag repairs the directory
    return loaded, engine.global_steps


def test_overwrite_killed_between_renames_stays_loadable(tmp_path):
    tmp = str(tmp_path)
    with pytest.raises(RankFailedError) as info:
        run_multirank(_overwrite_then_die, 2, args=(tmp,), timeout=60)
    assert "rank 0 exited with signal SIGKILL" in str(info.value)
    assert open(tmp_path / "latest").read() == "t"
    assert not (tmp_path / "t").exists() and (tmp_path / ".t.old" / "checkpoint.json").is_file()
    assert len(_good_state(tmp)) == 4  # the standalone reader falls back too
    assert run_multirank(_load_then_overwrite, 2, args=(tmp,)) == [(1, 2)] * 2
    assert not (tmp_path / ".t.old").exists()
    assert json.load(open(tmp_path / "t" / "checkpoint.json"))["global_steps"] == 2


def _save_two_ranks(tmp: str) -> None:
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(tmp, tag="t")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    run_multirank(_save_two_ranks, 2, args=(tmp,))
    return tmp


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupted_and_truncated_files_are_named(saved, tmp_path):
    from zero_core.checkpoint import CheckpointError

    d = _copy(saved, str(tmp_path / "flip"))
    path = os.path.join(d, "t", "rank_00001.safetensors")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors fails its checksum"):
        _good_state(d)

    d = _copy(saved, str(tmp_path / "trunc"))
    path = os.path.join(d, "t", "rank_00000.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors has \d+ bytes.*truncated"):
        _good_state(d)

    d = _copy(saved, str(tmp_path / "json"))
    path = os.path.join(d, "t", "rank_00000.json")
    with open(path, "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match=r"rank_00000\.json has \d+ bytes"):
        _good_state(d)


def _load_error(tmp: str) -> str:
    from zero_core.checkpoint import CheckpointError

    engine = _engine(2)
    try:
        engine.load_checkpoint(tmp, tag="t")
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_engine_load_names_a_corrupted_file_on_every_rank(saved, tmp_path):
    # each file is checksummed by exactly one rank, its verifier (see [Note: shared verification]):
    # rank 1 verifies rank_00001 and finds the flip; rank 0, which reads only its module-weight
    # ranges of that file at stage 2, learns it through the all-reduce and names the file too
    d = _copy(saved, str(tmp_path / "flip"))
    path = os.path.join(d, "t", "rank_00001.safetensors")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    e0, e1 = run_multirank(_load_error, 2, args=(d,))
    assert "rank_00001.safetensors fails its checksum" in e1, e1
    assert "rank_00001.safetensors failed verification on another rank" in e0, e0
    (e,) = run_multirank(_load_error, 1, args=(d,))  # one process verifies every file
    assert "rank_00001.safetensors fails its checksum" in e, e


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling would create the marker file


def _rerecord(tag_dir: str, rank: int) -> None:
    """Make the checksums (and the root record's seal) agree with a planted file, as an attacker could."""
    from zero_core.checkpoint.format import read_json
    from zero_core.checkpoint.integrity import file_crc32c, file_record
    from zero_core.checkpoint.metadata import sealed_bytes

    table_path = os.path.join(tag_dir, f"rank_{rank:05d}.json")
    table = json.load(open(table_path))
    n, crcs = file_crc32c(os.path.join(tag_dir, table["file"]))
    table["file_record"] = file_record(n, crc32c=crcs)
    open(table_path, "w").write(json.dumps(table))
    meta_path = os.path.join(tag_dir, "checkpoint.json")
    meta = read_json(meta_path)
    meta.pop("seal")
    meta["files"][f"rank_{rank:05d}.json"] = file_record(
        *file_crc32c(table_path)[:1], crc32c=file_crc32c(table_path)[1]
    )
    open(meta_path, "wb").write(sealed_bytes(meta))


def test_planted_pickle_is_rejected_not_executed(saved, tmp_path):
    from zero_core.checkpoint import CheckpointError

    marker = str(tmp_path / "PWNED")
    payload = pickle.dumps({"w": _Evil(marker)})
    d = _copy(saved, str(tmp_path / "evil"))
    tag_dir = os.path.join(d, "t")
    # under the name DeepSpeed would load, and under our own tensor file name
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        open(os.path.join(tag_dir, name), "wb").write(payload)
    assert len(_good_state(d)) == 4  # unknown files are ignored, never opened
    open(os.path.join(tag_dir, "rank_00000.safetensors"), "wb").write(payload)
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors fails its checksum|has \d+ bytes"):
        _good_state(d)
    _rerecord(tag_dir, 0)
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors is not a valid safetensors"):
        _good_state(d)
    assert not os.path.exists(marker)
    with pytest.raises(TypeError, match=r"client_state\['bad'\] is a tensor"):
        from zero_core.checkpoint.format import check_json_compatible

        check_json_compatible({"bad": torch.ones(1)}, "client_state")
