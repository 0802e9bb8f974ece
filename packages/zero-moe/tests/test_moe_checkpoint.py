"""Per-expert checkpoints: one safetensors file per global expert, loadable with another ep_size."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero_core.testing import run_multirank
from zero_moe import MoE, load_moe_checkpoint, save_moe_checkpoint

M, E = 8, 4


class TwoLayer(nn.Module):
    def __init__(self, ep_size: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(M, M)
        common = dict(num_experts=E, ep_size=ep_size, capacity_factor=4.0, use_rts=False)
        self.moe1 = MoE(M, nn.Linear(M, M), k=2, top2_2nd_expert_sampling=False, **common)
        self.moe2 = MoE(M, nn.Linear(M, M), k=1, use_residual=True, **common)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # distinct weights per global expert, independent of ep_size
            for layer in (self.moe1, self.moe2):
                full = [torch.randn(M, M, generator=g) for _ in range(E)]
                for i, expert in enumerate(layer.zero_moe.experts.zero_experts):
                    expert.weight.copy_(full[layer.global_expert_offset + i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        x = self.moe1(x)[0]
        return self.moe2(x)[0]


def _global_experts(model: TwoLayer) -> dict[tuple[int, int], torch.Tensor]:
    out = {}
    for layer_id, layer in enumerate((model.moe1, model.moe2)):
        for i, expert in enumerate(layer.zero_moe.experts.zero_experts):
            out[(layer_id, layer.global_expert_offset + i)] = expert.weight.detach().clone()
    return out


def test_roundtrip_single_process(tmp_path):
    model = TwoLayer(1, seed=0)
    save_moe_checkpoint(model, tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        ["moe_index.json", "non_expert.safetensors"]
        + [f"layer_{layer}_expert_{e}.safetensors" for layer in (0, 1) for e in range(E)]
    )
    index = json.loads((tmp_path / "moe_index.json").read_text())
    assert [entry["module"] for entry in index["layers"]] == ["moe1", "moe2"]
    other = TwoLayer(1, seed=5)
    x = torch.randn(6, M)
    assert not torch.allclose(other(x), model(x))
    load_moe_checkpoint(other, tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(other(x), model(x))


def test_load_rejects_mismatch(tmp_path):
    save_moe_checkpoint(TwoLayer(1, seed=0), tmp_path)
    wrong = nn.Module()
    wrong.moe = MoE(M, nn.Linear(M, M), num_experts=2)
    with pytest.raises(ValueError, match="MoE layers"):
        load_moe_checkpoint(wrong, tmp_path)
    wrong.moe2 = MoE(M, nn.Linear(M, M), num_experts=2)
    with pytest.raises(ValueError, match="saved with 4 experts"):
        load_moe_checkpoint(wrong, tmp_path)
    with pytest.raises(FileNotFoundError, match="moe_index.json"):
        load_moe_checkpoint(TwoLayer(1, seed=0), tmp_path / "missing")


def _reshard_worker(root: str) -> int:
    rank = dist.get_rank()
    x = torch.randn(10, M, generator=torch.Generator().manual_seed(rank))
    sharded = TwoLayer(2, seed=0)
    save_moe_checkpoint(sharded, f"{root}/ep2")
    replicated = TwoLayer(1, seed=3)  # different weights before loading
    load_moe_checkpoint(replicated, f"{root}/ep2")
    full = _global_experts(replicated)
    for key, weight in _global_experts(sharded).items():
        assert torch.equal(full[key], weight), key
    torch.testing.assert_close(replicated(x), sharded(x), rtol=1e-5, atol=1e-6)

    save_moe_checkpoint(replicated, f"{root}/ep1")
    resharded = TwoLayer(2, seed=4)
    load_moe_checkpoint(resharded, f"{root}/ep1")
    for key, weight in _global_experts(resharded).items():
        assert torch.equal(full[key], weight), key
    torch.testing.assert_close(resharded(x), sharded(x), rtol=1e-5, atol=1e-6)
    return len(full)


def test_reshard_between_ep_sizes(tmp_path):
    assert run_multirank(_reshard_worker, 2, args=(str(tmp_path),), timeout=120) == [2 * E, 2 * E]
    for sub in ("ep1", "ep2"):
        files = sorted(p.name for p in (tmp_path / sub).iterdir())
        assert len(files) == 2 + 2 * E and not any(".tmp" in f for f in files)
    _converts_and_inspects(tmp_path)


def _converts_and_inspects(tmp_path):
    """zero_to_fp32 turns the directory saved on 2 ranks (ep_size 2) into the full state dict of the
    model built with ep_size 1, every global expert under its global name; inspect verifies every file."""
    from zero_core.checkpoint.inspect import describe
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    full = TwoLayer(1, seed=7)
    load_moe_checkpoint(full, tmp_path / "ep2")
    want = full.state_dict()
    for sub in ("ep2", "ep1"):
        got = get_fp32_state_dict_from_zero_checkpoint(tmp_path / sub)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], v) for k, v in want.items())
    report = describe(str(tmp_path / "ep2"))
    assert "zero-moe experts (save_moe_checkpoint) | moe1: 4 experts, moe2: 4 experts" in report
    assert report.count(" OK") == 1 + 2 * E


def test_checkpoint_is_verified_sealed_and_crash_safe(tmp_path):
    """Expert files are checksummed, the index sealed; a failed save leaves the previous checkpoint."""
    from zero_core.checkpoint import CheckpointError, atomic

    ckpt = tmp_path / "moe"
    model = TwoLayer(1, seed=0)
    save_moe_checkpoint(model, ckpt)
    real = atomic._write_all

    def full(f, view):
        if "layer_1_expert_2" in f.name:
            raise OSError(28, "No space left on device")
        real(f, view)

    atomic._write_all = full
    try:
        with pytest.raises(OSError, match=r"No space left on device.*layer_1_expert_2\.safetensors"):
            save_moe_checkpoint(TwoLayer(1, seed=9), ckpt)
    finally:
        atomic._write_all = real
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe"]  # no staging directory, no temporary file
    with pytest.raises(
        ValueError, match="directory name of .*bad name is not usable: checkpoint tag must be"
    ):
        save_moe_checkpoint(model, tmp_path / "bad name")
    other = TwoLayer(1, seed=5)
    load_moe_checkpoint(other, ckpt)  # the previous checkpoint, whole
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name
    expert = ckpt / "layer_0_expert_1.safetensors"
    data = bytearray(expert.read_bytes())
    data[len(data) // 2] ^= 0x04
    expert.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"layer_0_expert_1\.safetensors fails its checksum"):
        load_moe_checkpoint(TwoLayer(1, seed=5), ckpt)
    index = json.loads((ckpt / "moe_index.json").read_text())
    index["layers"][0]["num_experts"] = 8
    (ckpt / "moe_index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"moe_index\.json fails its checksum \(seal\)"):
        load_moe_checkpoint(TwoLayer(1, seed=5), ckpt)
