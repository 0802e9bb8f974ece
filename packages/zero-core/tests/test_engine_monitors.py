"""Monitors through the engine: TensorBoard, CSV and W&B (offline) sections of the config, the
per-rank model-state memory (see [Note: per-rank model-state memory]) and wall_clock_breakdown."""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from zero_core.engine.engine import model_state_bytes
from zero_core.testing import run_multirank

VOCAB, MICRO, WORLD, STEPS, EVERY = 16, 2, 2, 4, 2
SCALARS = ["train_loss", "lr", "loss_scale", "samples_per_sec", "grad_norm"]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(x)).float().reshape(-1, VOCAB), y.reshape(-1))


def _train(out_dir: str) -> dict:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": EVERY,
        "wall_clock_breakdown": True,
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "tensorboard": {"enabled": True, "output_path": os.path.join(out_dir, "tb"), "job_name": "job"},
        "csv_monitor": {"enabled": True, "output_path": os.path.join(out_dir, "csv"), "job_name": "job"},
        "wandb": {"enabled": True, "project": "zero-test"},
    }
    engine, _, _, _ = zero_core.initialize(model=Tiny(), config=cfg)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for it in range(STEPS):
            g = torch.Generator().manual_seed(10 * it + rank)
            x = torch.randint(0, VOCAB, (MICRO, 4), generator=g)
            engine.backward(engine(x, x))
            engine.step()
    engine.monitor.close()
    return {"printed": printed.getvalue(), "mem": engine.memory_breakdown()}


def _read_tensorboard(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _read_csv(path: str) -> list[tuple[int, float]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return [(int(s), float(v)) for s, v in rows[1:]]


def test_engine_writes_tensorboard_csv_and_wandb(tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_SILENT": "true"}
    os.makedirs(env["WANDB_DIR"])
    results = run_multirank(_train, WORLD, args=(str(tmp_path),), env=env, timeout=180)

    samples = [MICRO * WORLD * (s + 1) for s in range(STEPS)]  # the x axis: global samples
    printed_at = [MICRO * WORLD * s for s in range(EVERY, STEPS + 1, EVERY)]
    tb = _read_tensorboard(str(tmp_path / "tb" / "job"))
    for name in SCALARS:
        tag = f"Train/Samples/{name}"
        assert [s for s, _ in tb[tag]] == samples, tag
        from_csv = _read_csv(str(tmp_path / "csv" / "job" / f"Train_Samples_{name}.csv"))
        assert [s for s, _ in from_csv] == samples, name
        # TensorBoard stores float32
        assert [v for _, v in from_csv] == pytest.approx([v for _, v in tb[tag]], rel=1e-6), name
    assert all(v == 256.0 for _, v in tb["Train/Samples/loss_scale"])
    assert [v for _, v in tb["Train/Samples/lr"]] == pytest.approx([1e-3] * STEPS)
    assert all(v > 0 for _, v in tb["Train/Samples/samples_per_sec"])

    # per-rank model-state memory at steps_per_print, measured on each rank
    mem_mb = [model_state_bytes(r["mem"]) / 2**20 for r in results]
    for r in range(WORLD):
        series = tb[f"Train/Memory/model_states_MB_rank{r}"]
        assert [s for s, _ in series] == printed_at
        assert all(abs(v - mem_mb[r]) < 1e-3 for _, v in series)
        from_csv = _read_csv(str(tmp_path / "csv" / "job" / f"Train_Memory_model_states_MB_rank{r}.csv"))
        assert [s for s, _ in from_csv] == printed_at
    assert [v for _, v in tb["Train/Memory/model_states_MB_max"]] == pytest.approx(
        [max(mem_mb)] * len(printed_at)
    )
    assert mem_mb[0] > 0

    # only rank 0 writes: one TensorBoard event file, one W&B offline run
    assert len(glob.glob(str(tmp_path / "tb" / "job" / "events.out.tfevents.*"))) == 1
    runs = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "*.wandb"))

    # progress lines (rank 0) with wall_clock_breakdown timings
    lines = [ln for ln in results[0]["printed"].splitlines() if ln.startswith("[zero] step")]
    assert len(lines) == STEPS // EVERY
    for line in lines:
        assert "loss scale 256" in line and "MB/rank" in line and "samples/s" in line
        for timer in ("forward", "backward", "backward_allreduce", "step"):
            assert f"{timer} " in line and " ms" in line, (timer, line)
    assert results[1]["printed"] == ""
