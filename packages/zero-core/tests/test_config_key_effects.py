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
    assert (
        state["zero_stage"] == 0
        and state["optimizer"] == "AdamW"
        and state["gradient_accumulation_steps"] == 1
    )
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
    return [
        (_masters_after_load(s, True, f"{path}/a{s}"), _masters_after_load(s, False, f"{path}/b{s}"))
        for s in (0, 1, 2, 3)
    ]


@pytest.mark.parametrize("world", [1, 2])
def test_load_from_fp32_weights_false_builds_masters_from_the_16bit_weights(world: int, tmp_path) -> None:
    for stage, ((saved, _), (rebuilt, weights)) in enumerate(
        run_multirank(_load_cases, world, args=(str(tmp_path),))[0]
    ):
        for m32, m16 in zip(saved, rebuilt):
            as_bf16 = torch.tensor(m32).bfloat16().float()
            assert torch.equal(torch.tensor(m16), as_bf16), f"stage {stage}: not the bf16 weights"
            assert not torch.equal(torch.tensor(m32), as_bf16), (
                f"stage {stage}: the saved masters are bf16 values"
            )
        if weights is not None:
            assert all(torch.equal(w.reshape(-1), torch.tensor(m)) for w, m in zip(weights, rebuilt))


def _progress(extra: dict, steps: int) -> list[str]:
    """The progress lines of ``steps`` optimizer steps (rank 0)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine, _ = _engine(extra)
        for _ in range(steps):
            engine.backward(engine(torch.ones(2, DIM)).pow(2).mean())
            engine.step()
        engine.destroy()
    return [line for line in out.getvalue().splitlines() if line.startswith("[zero] step")]


def test_steps_per_print_and_wall_clock_breakdown_shape_the_progress_line() -> None:
    every3, timed = run_multirank(
        lambda: (_progress({"steps_per_print": 3}, 6), _progress({"wall_clock_breakdown": True}, 2)), 1
    )[0]
    assert [line.split(" | ")[0] for line in every3] == ["[zero] step 3", "[zero] step 6"]
    assert len(timed) == 2 and all(
        "forward" in line and "backward" in line and " ms" in line for line in timed
    )
    assert not any(" ms" in line for line in every3)


def _timeouts() -> tuple[float, float]:
    from zero_core import comm

    before = comm.watchdog.collective_timeout()
    engine, _ = _engine({"comms_timeout": 7})
    engine.destroy()
    return before, comm.watchdog.collective_timeout()


def test_comms_timeout_bounds_every_collective() -> None:
    before, after = run_multirank(_timeouts, 1)[0]
    assert (
        after == 7.0 and before != 7.0
    )  # the collective watchdog's deadline: See [Note: collective watchdog]


def _step_collectives(extra_zero: dict, stage: int = 2) -> dict[str, int]:
    from zero_core.comm import comms_logger

    engine, _ = _engine(
        {"zero_optimization": {"stage": stage, **extra_zero}, "steps_per_print": 10**6}, stage
    )
    comms_logger.reset()
    comms_logger.enable()
    engine.backward(engine(torch.ones(2, DIM)).pow(2).mean())
    engine.step()
    comms_logger.disable()
    engine.destroy()
    ops = ("reduce_scatter_tensor", "all_reduce", "reduce", "all_gather_into_tensor", "broadcast")
    return {op: comms_logger.count_for(op) for op in ops}


def _knob_cases() -> dict:
    return {
        "base": _step_collectives({}),
        "allreduce": _step_collectives({"reduce_scatter": False}),
        "reduce": _step_collectives({"reduce_scatter": False, "use_multi_rank_bucket_allreduce": False}),
        "buckets": _step_collectives({"reduce_bucket_size": 20}),
        "broadcast": _step_collectives({"allgather_partitions": False}),
        "gather_pieces": _step_collectives({"allgather_bucket_size": 8}),
    }


def test_stage12_knobs_change_the_collectives() -> None:
    c = run_multirank(_knob_cases, 2)[0]
    assert c["base"]["reduce_scatter_tensor"] >= 1 and c["base"]["reduce"] == 0
    assert (
        c["allreduce"]["reduce_scatter_tensor"] == 0
        and c["allreduce"]["all_reduce"] > c["base"]["all_reduce"]
    )
    assert c["reduce"]["reduce_scatter_tensor"] == 0 and c["reduce"]["reduce"] > 0
    assert c["buckets"]["reduce_scatter_tensor"] > c["base"]["reduce_scatter_tensor"]
    assert c["broadcast"]["all_gather_into_tensor"] == 0 and c["broadcast"]["broadcast"] > 0
    assert c["gather_pieces"]["all_gather_into_tensor"] > c["base"]["all_gather_into_tensor"]


def _issued_before_backward_ended(stage: int, overlap: bool) -> int:
    from zero_core.comm import comms_logger

    zo = {"stage": stage, "reduce_bucket_size": 20, "overlap_comm": overlap}
    engine, _ = _engine({"zero_optimization": zo}, stage)
    op = "all_reduce" if stage == 0 else "reduce_scatter_tensor"
    seen = []
    after = engine.strategy.after_backward

    def spy(is_boundary: bool) -> None:
        seen.append(comms_logger.count_for(op))
        after(is_boundary)

    engine.strategy.after_backward = spy
    comms_logger.reset()
    comms_logger.enable()
    engine.backward(engine(torch.ones(2, DIM)).pow(2).mean())
    comms_logger.disable()
    engine.destroy()
    return seen[0]


def test_overlap_comm_launches_reductions_during_backward() -> None:
    cases = lambda: [_issued_before_backward_ended(s, o) for s in (0, 2) for o in (True, False)]  # noqa: E731
    stage0_on, stage0_off, stage2_on, stage2_off = run_multirank(cases, 2)[0]
    assert stage0_on > 0 and stage2_on > 0  # buckets reduced from the gradient hooks
    assert stage0_off == 0 and stage2_off == 0  # everything waits for the end of backward


def _grads_alive_late_in_backward(contiguous: bool) -> int:
    engine, model = _engine({"zero_optimization": {"stage": 2, "contiguous_gradients": contiguous}}, 2)
    alive = []
    first = model[0].weight  # its gradient comes last in backward
    others = [p for p in model.parameters() if p is not first]
    first.register_post_accumulate_grad_hook(lambda p: alive.append(sum(q.grad is not None for q in others)))
    engine.backward(engine(torch.ones(2, DIM)).pow(2).mean())
    engine.destroy()
    return alive[0]


def test_contiguous_gradients_frees_each_gradient_in_its_hook() -> None:
    on, off = run_multirank(
        lambda: (_grads_alive_late_in_backward(True), _grads_alive_late_in_backward(False)), 2
    )[0]
    assert on == 0 and off == 3  # copied into the bucket and freed at once, or kept until the launch


def _persistent(model_threshold: int | None) -> tuple[int, int]:
    zo = {"stage": 3, "param_persistence_threshold": 10**6}
    if model_threshold is not None:
        zo["model_persistence_threshold"] = model_threshold
    engine, _ = _engine({"zero_optimization": zo}, 3)
    out = len(engine.strategy.persistent), engine.memory_breakdown().get("persistent_parameters", 0)
    engine.destroy()
    return out


def test_model_persistence_threshold_caps_the_persistent_parameters() -> None:
    (all_count, all_bytes), (capped_count, capped_bytes) = run_multirank(
        lambda: (_persistent(None), _persistent(DIM + 1)), 2
    )[0]
    assert all_count == 4 and capped_count < all_count and capped_bytes < all_bytes


def test_synchronize_checkpoint_boundary_synchronizes_around_each_checkpoint(monkeypatch) -> None:
    from zero_core.activation_checkpointing import checkpointing as ac

    calls = []
    monkeypatch.setattr(ac, "_STATE", ac.CheckpointingState())  # unconfigured, and restored after
    monkeypatch.setattr(ac, "_synchronize", lambda: calls.append(1))
    block = nn.Linear(DIM, DIM)
    x = torch.randn(2, DIM, requires_grad=True)
    for sync in (False, True):
        ac.configure(synchronize=sync)
        ac.checkpoint(block, x).sum().backward()
        ac.reset()
    assert len(calls) == 4  # forward and recompute, two boundaries each, only when asked
