"""The main job (README quick start): ``zero run --nproc 2 examples/train_gpt.py`` trains the byte-level
GPT on the standard library's sources, the loss falls, and logs and a checkpoint are written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 30
# Stated margin: the loss at step 30 must be at least this many nats below the loss at step 1
# (step 1 is ~ln(256) = 5.55 for an untrained byte model; 30 steps reach ~3.0 on this config).
MARGIN_NATS = 0.5


def test_demo_loss_falls_on_two_ranks(tmp_path):
    out_dir = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "zero_core.launcher",
        "run",
        "--nproc",
        "2",
        os.path.join(ROOT, "examples", "train_gpt.py"),
        "--zero_config",
        os.path.join(ROOT, "examples", "configs", "stage0.json"),
        "--steps",
        str(STEPS),
        "--seq_len",
        "64",
        "--d_model",
        "64",
        "--n_layers",
        "2",
        "--n_heads",
        "2",
        "--corpus_bytes",
        "300000",
        "--out_dir",
        str(out_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output

    done = re.search(r"\[train_gpt\] done: (\d+) steps in [\d.]+ s; loss ([\d.]+) -> ([\d.]+)", output)
    assert done, output
    steps, first, last = int(done.group(1)), float(done.group(2)), float(done.group(3))
    assert steps == STEPS
    assert last < first - MARGIN_NATS, f"loss {first} -> {last}: did not fall by {MARGIN_NATS} nats"

    progress = re.findall(r"\[zero\] step (\d+) \| loss ([\d.]+) .*model states ([\d.]+) MB/rank", output)
    assert [int(s) for s, _, _ in progress] == [10, 20, 30]  # steps_per_print 10
    assert all(float(mb) > 0 for _, _, mb in progress)

    tb_dir = out_dir / "tensorboard" / "train_gpt"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb_dir))
    if "checkpoint:" not in output:
        pytest.fail(f"the demo did not report its checkpoint:\n{output}")
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == f"global_step{STEPS}"
