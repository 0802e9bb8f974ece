"""Where offloaded bytes live, and how NVMe failures are reported.

* memory: with optimizer offload, device-side model states are the parameters and gradients
  only (masters and Adam states move to ``host_*`` pools, measured from live tensors); with
  NVMe, resident CPU bytes for optimizer states (and, at stage 3, the fp32 masters swapped
  with them) stay within ``buffer_count`` x tile bytes.
* faults: an unwritable or full ``nvme_path`` fails at initialize naming the path; a swap file
  deleted mid-run is a clear error naming it; a missing zero-offload names the package.
"""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import MLPClassifier, classification_batch

_model = functools.partial(MLPClassifier, 32, 64, 8)
N_TRAINABLE = 32 * 64 + 64 + 64 * 8 + 8  # 2632


def _engine(stage: int, offload: dict | None, sub_group_size: int = 1000):
    import zero_core

    torch.manual_seed(0)
    model = _model()
    zc = {"stage": stage, "sub_group_size": sub_group_size}
    if offload is not None:
        zc["offload_optimizer"] = offload
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "zero_optimization": zc}
    engine, *_ = zero_core.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=cfg
    )
    return engine


def _train_one(engine) -> None:
    engine.backward(engine(*classification_batch(1, 4, 32, 8)))
    engine.step()


def _breakdowns(nvme: str) -> list[dict]:
    out = []
    for stage in (2, 3):
        for off in (
            None,
            {"device": "cpu"},
            {
                "device": "nvme",
                "nvme_path": nvme,
                "buffer_count": 3,
                "pipeline_read": True,
                "pipeline_write": True,
            },
        ):
            e = _engine(stage, off)
            _train_one(e)
            out.append(
                {"stage": stage, "off": None if off is None else off["device"], **e.memory_breakdown()}
            )
            e.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_offload_memory_device_side_is_params_and_grads(world: int, tmp_path) -> None:
    per_rank = run_multirank(_breakdowns, world, args=(str(tmp_path),), timeout=120)
    shard = -(-N_TRAINABLE // world)
    for bd in per_rank[0]:
        if bd["off"] is None:
            assert bd["optimizer_states"] >= 2 * 4 * (shard if bd["stage"] == 3 else N_TRAINABLE // world), bd
            continue
        # device side: no fp32 masters, no optimizer states
        assert bd["master_weights"] == 0 and bd["optimizer_states"] == 0, bd
        if bd["off"] == "cpu":
            assert bd["host_master_weights"] >= 4 * (N_TRAINABLE // world), bd
            # Adam's two states, plus its step counter (4 bytes) per master
            extra = bd["host_optimizer_states"] - 2 * bd["host_master_weights"]
            assert 0 < extra <= 4 * 16 and extra % 4 == 0, bd
            assert bd["host_swap_buffers"] == 0, bd
        elif bd["stage"] == 2:  # stages 1/2 keep the masters in CPU memory (as DeepSpeed)
            tile_bytes = 1024 * 2 * 4  # sub_group_size 1000 -> 1024-element aligned tile x 2 Adam states
            assert bd["host_master_weights"] >= 4 * (N_TRAINABLE // world), bd
            assert bd["host_optimizer_states"] <= 4 * 16, bd  # Adam's step counters only
            assert 0 < bd["host_swap_buffers"] <= 3 * tile_bytes, bd
        else:  # ZeRO-Infinity: masters and gradients swapped with the states, tile by tile
            tile_bytes = 1024 * 4 * 4  # 1024-element tile x (master + gradient + 2 Adam states)
            assert bd["host_master_weights"] == 0 and bd["host_optimizer_states"] <= 4 * 16, bd
            assert 0 < bd["host_swap_buffers"] <= 3 * tile_bytes, bd


def test_offload_nvme_unwritable_path_fails_at_initialize(tmp_path) -> None:
    ro = tmp_path / "readonly"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            # running as root: permissions do not stop us, use a path under a regular file instead
            blocker = tmp_path / "a_file"
            blocker.write_text("x")
            ro = blocker / "sub"
        with pytest.raises(Exception, match=re.escape(str(ro))):
            run_multirank(_engine, 1, args=(2, {"device": "nvme", "nvme_path": str(ro)}), timeout=60)
    finally:
        os.chmod(tmp_path / "readonly", 0o700)


def _full_disk(nvme: str) -> str:
    import zero_offload.swap_files as sf

    def no_space(fd, offset, length):
        raise OSError(28, os.strerror(28))  # ENOSPC, as posix_fallocate reports a full disk

    sf.os.posix_fallocate = no_space
    try:
        _engine(2, {"device": "nvme", "nvme_path": nvme})
    except OSError as exc:
        return str(exc)
    return "no error"


def test_offload_nvme_full_disk_fails_at_initialize(tmp_path) -> None:
    (msg,) = run_multirank(_full_disk, 1, args=(str(tmp_path),), timeout=60)
    assert "cannot reserve" in msg and str(tmp_path) in msg and "No space left" in msg, msg


def _delete_mid_run(nvme: str) -> str:
    e = _engine(2, {"device": "nvme", "nvme_path": nvme})
    _train_one(e)
    victim = next(iter(e.strategy.offload.swap_dir.files.values()))[0]
    os.remove(victim)
    try:
        _train_one(e)
    except OSError as exc:
        return f"{victim}|{exc}"
    finally:
        e.destroy()
    return "no error"


def test_offload_nvme_swap_file_removed_mid_run(tmp_path) -> None:
    (out,) = run_multirank(_delete_mid_run, 1, args=(str(tmp_path),), timeout=60)
    victim, msg = out.split("|", 1)
    assert victim in msg and "disappeared" in msg, out


def test_offload_missing_package_names_it(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "zero_offload" else real(name, *a)
    )
    with pytest.raises(Exception, match=r"pip install packages/zero-offload"):
        run_multirank(_engine, 1, args=(2, {"device": "cpu"}), timeout=60)


def test_offload_rejects_non_adam_optimizer() -> None:
    def build():
        import zero_core

        model = _model()
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        }
        try:
            zero_core.initialize(
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
            )
        except ValueError as exc:
            return str(exc)
        return "no error"

    (msg,) = run_multirank(build, 1, timeout=60)
    assert "CPUAdam" in msg and "SGD" in msg, msg


def test_offload_nvme_buffer_count_too_small_for_pipeline(tmp_path) -> None:
    from zero_offload import OptimizerOffload

    with pytest.raises(ValueError, match="buffer_count is 1"):
        OptimizerOffload("nvme", nvme_path=str(tmp_path), buffer_count=1, pipeline_read=True)
