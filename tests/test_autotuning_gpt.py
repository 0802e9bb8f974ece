"""``zero run --autotuning tune|run`` on the examples/ GPT (2 ranks, a bounded space): the search
finishes, writes the summary, the best config, its command and the plot, and ``--autotuning run``
launches the job with the best config. Cross-package: the example imports ``zero`` (the facade),
so this runs in the meta-package's environment. See [Note: autotuning search].
"""

from __future__ import annotations

import json
from pathlib import Path

from zero_core.testing.launch import experiment_records, run_zero, write_json

REPO = Path(__file__).resolve().parents[1]
PROFILE = {"start_profile_step": 1, "end_profile_step": 2}


def test_gpt_search_writes_results_and_runs_the_best(tmp_path: Path) -> None:
    cfg = write_json(
        tmp_path / "cfg.json",
        {
            "train_micro_batch_size_per_gpu": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": [0, 1]},
            "autotuning": {
                "enabled": True,
                **PROFILE,
                # kept to CI's budget (every launch costs seconds): one micro-batch size, so two
                # search launches, then the job; the model information is given and the confirm
                # phase is off here (both run for real, with the cheaper test job, in zero-profiler's
                # test_autotuning.py)
                "min_train_micro_batch_size_per_gpu": 2,
                "max_train_micro_batch_size_per_gpu": 2,
                "tuner_type": "gridsearch",
                "model_info": {"num_params": 7664},  # the GPT below (a launch less)
                "confirm_top_k": 0,
            },
        },
    )
    gpt = ["--steps", "4", "--seq_len", "16", "--d_model", "16", "--n_layers", "1", "--n_heads", "2"]
    gpt += ["--corpus_bytes", "20000", "--no_save", "--out_dir", str(tmp_path / "out")]
    out = run_zero(
        "--autotuning", "run", "--nproc", "2", str(REPO / "examples" / "train_gpt.py"), "--zero_config", str(cfg), *gpt,
        cwd=tmp_path,
    )  # fmt: skip
    results = tmp_path / "autotuning_results"
    records = experiment_records(tmp_path / "autotuning_exps")
    found = sorted((r["result"]["phase"], r["result"]["stage"], r["result"]["mbs"]) for r in records.values())
    assert found == [("search", 0, 2), ("search", 1, 2)]
    statuses = {n: (r["result"]["status"], r["result"]["reason"]) for n, r in records.items()}
    assert all(r["result"]["status"] == "ok" and r["result"]["metric"] > 0 for r in records.values()), (
        statuses
    )
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    best = max(records.values(), key=lambda r: r["result"]["metric"])["result"]
    assert optimal["zero_optimization"]["stage"] == best["stage"]
    assert optimal["train_micro_batch_size_per_gpu"] == best["mbs"]
    command = (results / "cmd_optimal.txt").read_text()
    assert (
        command.startswith("zero run --launcher torch --nproc 2 ")
        and str(results / "ds_config_optimal.json") in command
    )
    summary = (results / "summary.md").read_text()
    assert all(name in summary for name in records) and "Best: **" in summary
    assert (results / "metric_vs_micro_batch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[autotuning] [" in out  # the progress bar
    # --autotuning run: the job itself then ran with the best config, to the end
    assert "launching the job with" in out and "[train_gpt] done: 4 steps" in out
