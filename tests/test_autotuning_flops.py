"""``autotuning.metric: flops``: every experiment's metric is the FLOPS the engine measured with
zero-profiler's flops profiler (one step's FLOPs over the mean step time of the profile window).
Cross-package (zero-profiler's autotuner and profiler measuring zero-core's engine), so it runs in
the meta-package's environment. See [Note: autotuning experiments].
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "packages" / "zero-profiler" / "tests" / "_autotuning_job.py"


def test_flops_metric_is_the_profilers_flops_over_the_step_time(tmp_path: Path) -> None:
    mbs = 4
    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": mbs,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 0},
                "autotuning": {
                    "enabled": True,
                    "metric": "flops",
                    "start_profile_step": 2,
                    "end_profile_step": 4,
                    "model_info": {"num_params": 577},
                },
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "zero_core.launcher", "run", "--autotuning", "tune", "--nproc", "1",
         str(JOB), "--zero_config", str(cfg)],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    records = [json.loads(p.read_text())["result"] for p in (tmp_path / "autotuning_exps").glob("*.json")]
    assert len(records) == 1 and records[0]["status"] == "ok", records
    result = records[0]
    metrics = result["metrics"]
    assert result["metric"] == metrics["FLOPS_per_gpu"] > 0
    # one training step of the job's MLP (Linear 16->32, ReLU, Linear 32->1) on mbs samples, in
    # the profiler's convention (2 FLOPs per multiply-accumulate): the forward matmuls, the
    # backward's weight gradients of both layers and the input gradient of the second (the
    # input needs none); the biases and the ReLU add at most a few FLOPs per element
    matmuls = 2 * mbs * (16 * 32 + 32) + 2 * mbs * 16 * 32 + 2 * 2 * mbs * 32
    step_flops = metrics["FLOPS_per_gpu"] * metrics["latency"]
    assert matmuls <= step_flops <= matmuls + 8 * mbs * (32 + 32 + 1), (step_flops, matmuls)
    # the window's timing is the throughput's too: one measurement, two views of it
    assert abs(metrics["throughput"] * metrics["latency"] - mbs) < 1e-6 * mbs
    summary = (tmp_path / "autotuning_results" / "summary.md").read_text()
    assert "FLOPS/GPU" in summary
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert "flops_profiler" not in optimal and "autotuning" not in optimal
