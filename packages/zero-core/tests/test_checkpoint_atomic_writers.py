"""The whole-content forms of the one atomic writer (see [Note: one atomic writer] in
``checkpoint/atomic.py``): text, JSON, safetensors and a named temporary path, each written
under its final name only once complete, the previous file intact and no temporary left after a
failure."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from zero_core.checkpoint import atomic
from zero_core.checkpoint.atomic import (
    atomic_path,
    atomic_write_json,
    atomic_write_safetensors,
    atomic_write_text,
)


def test_text_and_json_round_trip(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "héllo\n")
    assert (tmp_path / "a.txt").read_bytes() == "héllo\n".encode()
    atomic_write_json(str(tmp_path / "b.json"), {"z": 1, "a": [1, 2]})
    text = (tmp_path / "b.json").read_text()
    assert json.loads(text) == {"z": 1, "a": [1, 2]}
    assert text == json.dumps({"z": 1, "a": [1, 2]}, indent=2, sort_keys=True)
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.json"]


def test_safetensors_round_trip_with_metadata(tmp_path):
    path = str(tmp_path / "m.safetensors")
    tensors = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    atomic_write_safetensors(path, tensors, metadata={"format": "pt"})
    back = load_file(path)
    assert (
        set(back) == {"w", "b"} and torch.equal(back["w"], tensors["w"]) and back["b"].dtype == torch.bfloat16
    )
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_a_failed_path_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.png"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer failed"), atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise RuntimeError("writer failed")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.png"]
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"new")
        assert path.read_bytes() == b"old"  # nothing under the final name until the block ends
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.png"]


def test_a_full_disk_names_the_file_not_a_checkpoint(tmp_path, monkeypatch):
    def full(f, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "_write_all", full)
    path = tmp_path / "summary.md"
    path.write_text("old")
    with pytest.raises(
        OSError, match=r"No space left on device while writing file after 0 bytes \(free space"
    ):
        atomic_write_text(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["summary.md"]
