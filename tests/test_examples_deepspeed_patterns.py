"""The two DeepSpeedExamples patterns under examples/deepspeed_patterns/ run with ``zero run
--nproc 2``: the CIFAR engine loop (with its MoE option, experts split over the 2 ranks) and the
pipeline script (``train_batch()`` over initialize's ``training_data``). Briefly: the losses must
fall and the scripts must report what DeepSpeed's print."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "deepspeed_patterns")


def _zero_run(tmp_path, script: str, *args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "zero_core.launcher",
        "run",
        "--nproc",
        "2",
        os.path.join(EXAMPLES, script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return output


def test_cifar_engine_loop_with_moe_on_two_ranks(tmp_path):
    out = _zero_run(
        tmp_path,
        "cifar_engine_loop.py",
        "--deepspeed",
        "--moe",
        "--ep-world-size",
        "2",
        "--num-experts",
        "2",
        "--moe-param-group",
        "--samples",
        "1024",
        "--log-interval",
        "8",
        "--max-steps",
        "32",
    )
    lines = [float(m) for m in re.findall(r"\[\s*1,\s+\d+\] loss:\s+([\d.]+)", out)]
    assert len(lines) == 4, out  # every 8 of 32 micro-batches, on rank 0 only
    done = re.search(r"done: 32 steps; first loss ([\d.]+); accuracy ([\d.]+)%", out)
    assert done, out
    assert lines[-1] < float(done.group(1)) - 0.4, out  # ln(10) = 2.30 at the start
    assert float(done.group(2)) > 25.0, out  # 10 classes: chance is 10%


def test_pipeline_train_batch_over_training_data_on_two_ranks(tmp_path):
    out = _zero_run(
        tmp_path,
        "pipeline_train.py",
        "--deepspeed_config",
        os.path.join(EXAMPLES, "pipeline_config.json"),
        "--steps",
        "40",
        "--samples",
        "512",
    )
    progress = re.findall(r"steps: (\d+) loss: ([\d.]+) iter time \(s\): [\d.]+ samples/sec: [\d.]+", out)
    assert [int(s) for s, _ in progress] == [10, 20, 30, 40], out  # steps_per_print 10, DeepSpeed's line
    done = re.search(r"done: 40 batches; loss ([\d.]+) -> ([\d.]+)", out)
    assert done, out
    assert float(done.group(2)) < float(done.group(1)) - 0.5, out
