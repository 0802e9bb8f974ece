"""Effect tests of config keys that had none: each shows the run (or what it prints) change.

``dump_state`` prints the engine's resolved state once; ``memory_breakdown`` adds this rank's
memory by category to the progress line; ``timers.throughput.enabled: false`` drops samples/s
from it; ``zero_optimization.load_from_fp32_weights: false`` builds the fp32 masters from the
saved 16-bit weights instead of the saved masters, at every stage. The rule these tests serve:
[Note: config key truth] in zero_core/config/key_paths.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank

DIM = 8


def _engine(extra: dict, stage: int = 0):
    import zero_core

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1, "zero_optimization": {"stage": stage}}
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
    engine, *_ = zero_core.initialize(model=model, config={**cfg, **extra})
    return engine, model


def _printed(extra: dict) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine, _ = _engine(extra)
        engine.backward(engine(torch.ones(2, DIM)).pow(2).mean())
        engine.step()
        engine.destroy()
    return out.getvalue()


def test_dump_state_prints_the_engine_state_once() -> None:
    plain, dumped = run_multirank(lambda: (_printed({}), _printed({"dump_state": True})), 1)[0]
    assert "engine state (dump_state)" not in plain
    head, _, body = dumped.partition("[zero] engine state (dump_state):\n")
    state = json.loads(body[: body.index("\n}\n") + 2])
    assert state["zero_stage"] == 0 and state["optimizer"] == "AdamW" and state["gradient_accumulation_steps"] == 1
    assert state["config"]["dump_state"] is True and state["config"]["steps_per_print"] == 1


def test_memory_breakdown_and_throughput_switch_change_the_progress_line() -> None:
    plain, breakdown, no_throughput = run_multirank(
        lambda: (
            _printed({}),
            _printed({"memory_breakdown": True}),
            _printed({"timers": {"throughput": {"enabled": False}}}),
        ),
        1,
    )[0]
    assert "samples/s" in plain and "memory (this rank)" not in plain
    assert "memory (this rank) parameters" in breakdown and "optimizer_states" in breakdown
    assert "[zero] step 1" in no_throughput and "samples/s" not in no_throughput


def _masters_after_load(stage: int, from_fp32: bool, path: str) -> list[list[float]]:
    """bf16 training, saved after 3 steps; loaded into a fresh engine: its fp32 masters."""
    from zero_core import comm
    from zero_core.zero.debug_access import safe_get_full_fp32_param

    engine, model = _engine({"bf16": {"enabled": True}}, stage)
    for step in range(3):
        x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(step + 10 * comm.get_rank()))
        engine.backward(engine(x.bfloat16()).float().pow(2).mean())
        engine.step()
    engine.save_checkpoint(path, tag="t")
    engine.destroy()
    zo = {"stage": stage, "load_from_fp32_weights": from_fp32}
    fresh, model = _engine({"bf16": {"enabled": True}, "zero_optimization": zo}, stage)
    fresh.load_checkpoint(path, tag="t")
    masters = [safe_get_full_fp32_param(p) for p in model.parameters()]
    weights = [p.detach().float() for p in model.parameters()] if stage < 3 else None
    fresh.destroy()
    return [m.reshape(-1).tolist() for m in masters], weights


def _load_cases(path: str) -> list:
    return [(_masters_after_load(s, True, f"{path}/a{s}"), _masters_after_load(s, False, f"{path}/b{s}")) for s in (0, 1, 2, 3)]


@pytest.mark.parametrize("world", [1, 2])
def test_load_from_fp32_weights_false_builds_masters_from_the_16bit_weights(world: int, tmp_path) -> None:
    for stage, ((saved, _), (rebuilt, weights)) in enumerate(run_multirank(_load_cases, world, args=(str(tmp_path),))[0]):
        for m32, m16 in zip(saved, rebuilt):
            as_bf16 = torch.tensor(m32).bfloat16().float()
            assert torch.equal(torch.tensor(m16), as_bf16), f"stage {stage}: not the bf16 weights"
            assert not torch.equal(torch.tensor(m32), as_bf16), f"stage {stage}: the saved masters are bf16 values"
        if weights is not None:
            assert all(torch.equal(w.reshape(-1), torch.tensor(m)) for w, m in zip(weights, rebuilt))
