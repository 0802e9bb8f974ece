"""load_checkpoint's options, save's exclude_frozen_parameters, and fp16 dynamic loss-scale resume."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not ~4 s in every forked rank)
import torch.nn as nn
import zero_core.engine  # noqa: F401
from zero_core.testing import run_multirank


class Net(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 10)
        self.frozen = nn.Linear(10, 10)
        self.frozen.requires_grad_(False)
        self.l2 = nn.Linear(10, 3)
        if extra:
            self.extra = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l2(torch.relu(self.frozen(torch.relu(self.l1(x)))))
        if hasattr(self, "extra"):
            h = self.extra(h)
        return h.float().pow(2).mean()


def _engine(stage: int, seed: int, extra: bool = False):
    import zero_core

    torch.manual_seed(seed)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        # 2**24 overflows fp16 gradients at first: the scale drops and steps are skipped
        "fp16": {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 3, "hysteresis": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},
    }
    engine, *_ = zero_core.initialize(model=Net(extra), config=cfg)
    return engine


def _train(engine, first: int, last: int) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in range(first, last):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = engine(torch.randn(2, 6, generator=g).half())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names) -> bool:
    return all(torch.equal(a[n], b[n]) for n in names)


def _scenarios(tmp: str, stage: int) -> dict:
    from zero_core.checkpoint import CheckpointError

    d = os.path.join(tmp, f"s{stage}")
    trainable = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    everything = trainable + ["frozen.weight", "frozen.bias"]

    # -- the run that saves ---------------------------------------------------------
    a = _engine(stage, 0)
    _train(a, 0, 8)
    scaler = a.loss_scaler.state_dict()
    assert a.skipped_steps > 0 and scaler != _engine(stage, 0).loss_scaler.state_dict()  # the scale moved
    a.save_checkpoint(d, tag="full", client_state={"k": 1})
    a.save_checkpoint(d, tag="nofrozen", exclude_frozen_parameters=True, save_latest=False)
    saved_w, saved_sched = _weights(a), a.lr_scheduler.state_dict()
    steps, skipped = a.global_steps, a.skipped_steps
    losses_a = _train(a, 8, 12)

    # -- fp16 dynamic loss scale resume: scale and counters restored, training bitwise equal --
    b = _engine(stage, 5)
    b.load_checkpoint(d, tag="full")
    assert b.loss_scaler.state_dict() == scaler
    assert (b.global_steps, b.skipped_steps) == (steps, skipped)
    assert _train(b, 8, 12) == losses_a

    # -- load_optimizer_states=False: weights and counters, no optimizer state ----------
    c = _engine(stage, 5)
    c.load_checkpoint(d, tag="full", load_optimizer_states=False)
    assert _equal(_weights(c), saved_w, everything) and c.global_steps == steps
    assert all(len(s) == 0 for s in c.optimizer.state.values())

    # -- load_lr_scheduler_states=False: the scheduler keeps its own state -------------
    e = _engine(stage, 5)
    fresh_sched = e.lr_scheduler.state_dict()
    e.load_checkpoint(d, tag="full", load_lr_scheduler_states=False)
    assert e.lr_scheduler.state_dict() == fresh_sched != saved_sched and e.global_steps == steps
    f = _engine(stage, 5)
    f.load_checkpoint(d, tag="full")
    assert f.lr_scheduler.state_dict() == saved_sched

    # -- load_module_only: weights only; counters, scaler, optimizer untouched ---------
    m = _engine(stage, 5)
    fresh_scaler = m.loss_scaler.state_dict()
    _, client = m.load_checkpoint(d, tag="full", load_module_only=True)
    assert _equal(_weights(m), saved_w, everything) and client == {"k": 1}
    assert m.global_steps == 0 and m.skipped_steps == 0 and m.loss_scaler.state_dict() == fresh_scaler
    assert all(len(s) == 0 for s in m.optimizer.state.values())
    assert m.lr_scheduler.state_dict() == fresh_sched

    # -- load_module_strict: a model with an extra layer --------------------------------
    x = _engine(stage, 5, extra=True)
    with pytest.raises(CheckpointError, match=r"missing parameters \['extra\.weight', 'extra\.bias'\]"):
        x.load_checkpoint(d, tag="full")
    x = _engine(stage, 5, extra=True)
    extra_before = _weights(x)
    x.load_checkpoint(d, tag="full", load_module_strict=False)
    got = _weights(x)
    assert _equal(got, saved_w, everything) and _equal(got, extra_before, ["extra.weight", "extra.bias"])
    _train(x, 8, 9)  # and it still trains

    # -- custom_load_fn: gets the whole saved module state and the module ---------------
    seen = {}

    def custom(src, dst):
        seen["keys"], seen["dst"] = sorted(src), dst
        seen["equal"] = _equal(src, saved_w, everything)

    y = _engine(stage, 5)
    y.load_checkpoint(d, tag="full", custom_load_fn=custom)
    assert seen["dst"] is y.module and seen["equal"] and seen["keys"] == sorted(everything)
    with pytest.raises(TypeError, match="custom_load_fn must be callable"):
        y.load_checkpoint(d, tag="full", custom_load_fn=3)

    # -- exclude_frozen_parameters on save: frozen weights absent, loading keeps the model's ---
    z = _engine(stage, 5)
    frozen_before = _weights(z)
    z.load_checkpoint(d, tag="nofrozen")
    got = _weights(z)
    assert _equal(got, saved_w, trainable) and _equal(got, frozen_before, ["frozen.weight", "frozen.bias"])
    assert not _equal(frozen_before, saved_w, ["frozen.weight"])  # the seeds differ: the check can fail
    return {}


@pytest.mark.parametrize("stage", [0, 2])
def test_load_options(tmp_path, stage):
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run_multirank(_scenarios, 2, args=(str(tmp_path), stage))
    d = tmp_path / f"s{stage}"
    names = {
        rec["name"]
        for r in range(2)
        for rec in json.load(open(d / "nofrozen" / f"rank_{r:05d}.json"))["fragments"]
    }
    assert names and not any(n.startswith("frozen.") for n in names)
    assert set(get_fp32_state_dict_from_zero_checkpoint(str(d), tag="nofrozen")) == {
        "l1.weight",
        "l1.bias",
        "l2.weight",
        "l2.bias",
    }
    assert len(get_fp32_state_dict_from_zero_checkpoint(str(d), tag="full")) == 6


def test_client_state_that_looks_like_a_float_tag_round_trips(tmp_path):
    """A saved dict keyed ``__float__`` came back as a float, or made the checkpoint unreadable (and
    with it zero_to_fp32 and inspect_checkpoint); such keys are escaped (see [Note: JSON float tags])."""
    import math

    from zero_core.checkpoint import zero_to_fp32 as z
    from zero_core.checkpoint.format import dumps, loads

    client = {
        "x": {"__float__": "nan"},
        "y": [{"__float__": "hello"}, {"__float__": 1, "b": 2}],
        "__zero_key__k": {"__zero_key____float__": 3},
        "inf": float("-inf"),
        "plain": {"a": [1, 2.5, None, True, "s"]},
    }
    data = dumps(client)
    path = tmp_path / "c.json"
    path.write_bytes(data)
    # the engine's reader and the standalone script's reader agree
    for got in (loads(data, "c.json"), z._read_json(str(path))):
        assert got.pop("inf") == float("-inf") and got == {k: v for k, v in client.items() if k != "inf"}
    assert math.isnan(loads(dumps({"n": float("nan")}), "n")["n"])
