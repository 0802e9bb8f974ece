"""The demo reports the same model at stage 3 as at stage 2: its full parameter count (not the
1/N a rank keeps), and less model-state memory per rank than stage 2, as ZeRO stage 3 holds."""

from __future__ import annotations

import os
import sys

from zero_core.engine.engine import model_state_bytes
from zero_core.testing import run_multirank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _demo(stage: int, out_dir: str) -> dict:
    sys.path.insert(0, EXAMPLES)
    import train_gpt

    argv = ["--zero_config", os.path.join(EXAMPLES, "configs", f"stage{stage}.json"), "--steps", "2"]
    argv += ["--seq_len", "32", "--corpus_bytes", "60000", "--no_save", "--out_dir", out_dir]
    res = train_gpt.main(argv)
    return {k: res[k] for k in ("params", "params_after_initialize")} | {
        "states": model_state_bytes(res["memory"])
    }


def test_stage3_demo_counts_full_parameters_and_holds_less_than_stage2(tmp_path):
    by_stage = {s: run_multirank(_demo, 2, args=(s, str(tmp_path / f"s{s}")), timeout=300) for s in (2, 3)}
    full = by_stage[2][0]["params"]
    assert full > 800_000  # the default model: 0.84M parameters
    for stage, ranks in by_stage.items():
        for r, res in enumerate(ranks):
            assert res["params"] == res["params_after_initialize"] == full, (stage, r, res)
    for r in range(2):
        assert by_stage[3][r]["states"] < by_stage[2][r]["states"], (r, by_stage)
