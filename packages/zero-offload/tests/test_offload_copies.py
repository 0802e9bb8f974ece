"""Offload copies are non-blocking between pinned host buffers and the device, fenced by events.

On CPU the copies are synchronous, so a missing event would go unnoticed; the recording
accelerator of ``zero_core.testing.streams`` logs every pin request, copy (with its
``non_blocking`` flag), event record and host wait, and the CPU Adam kernel's calls are logged
into the same sequence. Checked (see [Note: offload copies]):

* the staged-gradient host buffers are pinned through the accelerator;
* every device->host gradient copy is non-blocking and followed by an event that the host waits
  for before the CPU Adam kernel reads the gradients;
* the event behind a step's copy-back is waited for before the next step writes the buffers;
* no cross-stream race at stage 3 (side streams plus offload), and the losses match a run on
  the plain CPU accelerator.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_core.testing import run_multirank

WORLD, MICRO, DIM, STEPS = 2, 2, 8, 3


def _train(stage: int, record: bool) -> dict:
    import zero_core
    import zero_offload.offload_step as offload_step
    from zero_core import comm
    from zero_core.accelerator import CpuAccelerator, set_accelerator
    from zero_core.testing.streams import RecordingAccelerator

    acc = RecordingAccelerator() if record else CpuAccelerator()
    set_accelerator(acc)
    if record:

        class _LoggedKernel(offload_step.CPUAdamKernel):
            def step(self, *args, **kwargs):
                acc._log("adam", "host")
                return super().step(*args, **kwargs)

        offload_step.CPUAdamKernel = _LoggedKernel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": DIM * DIM,
            "offload_optimizer": {"device": "cpu"},
        },
    }
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    off = engine.strategy.offload
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + comm.get_rank())
        x, y = torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)
        ctx = acc.recording() if record and step > 0 else _nothing()
        with ctx:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    out = {"losses": losses}
    if record:
        grads = {acc._ids_of.of(grp.grad) for grp in off.groups}
        out.update(
            log=[e[:3] + e[4:5] + e[6:] if e[0] == "op" else e for e in acc.log],
            grads=grads,
            grads_pinned=all(grp.grad.untyped_storage().data_ptr() in acc.pinned for grp in off.groups),
            races=acc.races(),
        )
    engine.destroy()
    return out


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _check_fences(log: list[tuple], grads: set[int]) -> None:
    """Each Adam call comes after a host wait on an event recorded after every gradient copy."""
    copies = [i for i, e in enumerate(log) if e[0] == "op" and "copy" in e[2] and set(e[3]) & grads]
    adams = [i for i, e in enumerate(log) if e[0] == "adam"]
    assert copies and adams
    for i in copies:
        assert log[i][4]["non_blocking"], f"blocking gradient copy: {log[i]}"
    for a in adams:
        last_copy = max((i for i in copies if i < a), default=None)
        assert last_copy is not None
        recorded = {e[2]: i for i, e in enumerate(log) if e[0] == "record" and last_copy < i < a}
        waited = [
            i for i, e in enumerate(log) if e[0] == "event_sync" and e[2] in recorded and i > recorded[e[2]]
        ]
        assert any(i < a for i in waited), (
            f"Adam at #{a} reads gradients copied at #{last_copy} without an event"
        )
    # the copy-back of a step is fenced before the next step's kernel writes the buffers
    steps = [a for a in adams if a - 1 not in adams]
    for prev_end, nxt in zip(adams, steps[1:]):
        recorded = {e[2]: i for i, e in enumerate(log) if e[0] == "record" and i > prev_end and i < nxt}
        assert any(e[0] == "event_sync" and e[2] in recorded for e in log[prev_end:nxt]), nxt


def _both_stages() -> list[tuple[dict, dict]]:
    """Stages 2 and 3, each on the plain CPU accelerator and recorded (one launch)."""
    return [(_train(stage, False), _train(stage, True)) for stage in (2, 3)]


def test_offload_copies_are_pinned_non_blocking_and_fenced():
    for rank, runs in enumerate(run_multirank(_both_stages, WORLD, timeout=300)):
        for stage, (plain, out) in zip((2, 3), runs):
            assert out["races"] == [], (rank, stage, out["races"][:5])
            assert out["grads_pinned"], (rank, stage)
            _check_fences(out["log"], out["grads"])
            assert out["losses"] == pytest.approx(plain["losses"], rel=1e-6), (rank, stage)
