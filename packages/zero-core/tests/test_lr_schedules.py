"""The five LR schedules against closed-form references written here from the documented formulas."""

from __future__ import annotations

import json
import math

import pytest
import torch
from zero_core.lr_schedules import (
    VALID_LR_SCHEDULES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)

STEPS = 2000


def _optimizer(kind: str = "sgd", groups: int = 1, lr: float = 0.1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr * (g + 1)} for g in range(groups)]
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999))
    if kind == "sgd_mom":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


# ------------------------------------------------------------------------------ references (closed form)
def ref_range_test(i, min_lr=1e-3, size=2000, rate=1.0, staircase=False):
    interval = (i + 1) / size
    if staircase:
        interval = math.floor(interval)
    return min_lr * (1 + rate * interval)


def ref_one_cycle_scale(i, first, second):
    total = first + second
    t = i + 1
    cycle = math.floor(1 + t / total)
    x = 1.0 + t / total - cycle
    ratio = first / total
    return x / ratio if x <= ratio else (x - 1) / (ratio - 1)


def ref_one_cycle(i, lo, hi, first, second=None, decay_rate=0.0, decay_size=0, mlo=0.8, mhi=0.9, mdecay=0.0):
    second = first if second is None else second
    total = first + second
    if i < total:
        s = ref_one_cycle_scale(i, first, second)
        return lo + (hi - lo) * s, mhi - (mhi - mlo) * s
    if decay_size == 0:
        return lo, mhi
    d = (i - total + 1) / decay_size
    return lo / (1 + decay_rate * d), mhi * (1 + mdecay * d)


def ref_gamma(i, n, kind):
    n = max(2, n)
    if i < n:
        return math.log(i + 1) / math.log(n) if kind == "log" else i / n
    return None


def ref_warmup(i, lo=0.0, hi=0.001, n=1000, kind="log"):
    g = ref_gamma(i, n, kind)
    return lo + (hi - lo) * (1.0 if g is None else g)


def ref_warmup_decay(i, total, lo=0.0, hi=0.001, n=1000, kind="log"):
    g = ref_gamma(i, n, kind)
    if g is None:
        g = max(0.0, (total - i) / max(1.0, total - max(2, n)))
    return lo + (hi - lo) * g


def ref_cosine(i, base, total, min_ratio=0.0, n=1000, cos_min=1e-4, kind="log"):
    g = ref_gamma(i, n, kind)
    if g is not None:
        return base * (min_ratio + (1 - min_ratio) * g)
    s = min(i - n + 1, total - n)
    ratio = cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * s / (total - n)))
    return base * ratio


def _run(sched, steps=STEPS):
    lrs = []
    for _ in range(steps):
        sched.step()
        lrs.append([g["lr"] for g in sched.optimizer.param_groups])
        assert sched.get_last_lr() == lrs[-1]
        assert sched.get_lr() == lrs[-1]
    return lrs


def _assert_close(got, want, where):
    assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15), f"{where}: {got} != {want}"


# ------------------------------------------------------------------------------ values over 2,000 steps
@pytest.mark.parametrize("staircase", [False, True])
def test_range_test_defaults_and_custom(staircase):
    opt = _optimizer()
    sched = LRRangeTest(opt, lr_range_test_staircase=staircase)
    assert opt.param_groups[0]["lr"] == 1e-3  # starting point written at construction
    for i, (lr,) in enumerate(_run(sched)):
        _assert_close(lr, ref_range_test(i, staircase=staircase), f"step {i}")
    sched = LRRangeTest(_optimizer(groups=2), [1e-4, 2e-4], 100, 0.5, staircase)
    for i, lrs in enumerate(_run(sched)):
        for g, lo in enumerate([1e-4, 2e-4]):
            _assert_close(lrs[g], ref_range_test(i, lo, 100, 0.5, staircase), f"step {i} group {g}")


@pytest.mark.parametrize("kind", ["adam", "sgd_mom"])
def test_one_cycle_lr_and_momentum(kind):
    opt = _optimizer(kind)
    sched = OneCycle(opt, 1e-4, 1e-3, decay_lr_rate=0.5, cycle_first_step_size=300, cycle_second_step_size=500,
                     decay_step_size=50, cycle_min_mom=0.85, cycle_max_mom=0.95, decay_mom_rate=0.01)  # fmt: skip
    for i in range(STEPS):
        sched.step()
        want_lr, want_mom = ref_one_cycle(i, 1e-4, 1e-3, 300, 500, 0.5, 50, 0.85, 0.95, 0.01)
        group = opt.param_groups[0]
        _assert_close(group["lr"], want_lr, f"lr step {i}")
        mom = group["betas"][0] if kind == "adam" else group["momentum"]
        _assert_close(mom, want_mom, f"momentum step {i}")
        if kind == "adam":
            assert group["betas"][1] == 0.999


def test_one_cycle_defaults():
    opt = _optimizer("adam")
    sched = OneCycle(opt, 0.0001, 0.0010)
    assert opt.param_groups[0]["lr"] == 0.0001 and opt.param_groups[0]["betas"][0] == 0.9
    for i in range(STEPS + 2100):  # defaults: 2000 up, 2000 down, no decay
        sched.step()
        want_lr, want_mom = ref_one_cycle(i, 1e-4, 1e-3, 2000)
        _assert_close(opt.param_groups[0]["lr"], want_lr, f"step {i}")
        _assert_close(opt.param_groups[0]["betas"][0], want_mom, f"mom step {i}")
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_one_cycle_staircase_and_no_momentum_optimizer():
    sched = OneCycle(_optimizer(), 0.0, 1.0, cycle_first_step_size=100, cycle_first_stair_count=4)
    lrs = [lr for (lr,) in _run(sched, 200)]
    # First half: 4 stairs of 25 steps each; second half: 4 stairs going down.
    assert sorted(set(round(x, 12) for x in lrs[:99])) == [0.0, 0.25, 0.5, 0.75]
    assert lrs[99] == 1.0
    assert sorted(set(round(x, 12) for x in lrs[100:199])) == [0.25, 0.5, 0.75, 1.0]
    for i, lr in enumerate(lrs):
        s = ref_one_cycle_scale(i, 100, 100)
        want = math.floor(s * 4) / 4 if i < 99 else math.ceil(s * 4) / 4
        _assert_close(lr, want, f"step {i}")
    adagrad = _optimizer("adagrad")
    sched = OneCycle(adagrad, 0.01, 0.1)  # no momentum: lr still cycles
    assert sched.cycle_momentum is False and sched.get_mom() is None
    sched.step()
    _assert_close(adagrad.param_groups[0]["lr"], ref_one_cycle(0, 0.01, 0.1, 2000)[0], "adagrad")


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    for i, (lr,) in enumerate(_run(WarmupLR(_optimizer(), warmup_type=kind))):
        _assert_close(lr, ref_warmup(i, kind=kind), f"default step {i}")
    sched = WarmupLR(_optimizer(groups=2), [0.01, 0.02], [0.1, 0.2], 300, kind)
    for i, lrs in enumerate(_run(sched)):
        _assert_close(lrs[0], ref_warmup(i, 0.01, 0.1, 300, kind), f"step {i}")
        _assert_close(lrs[1], ref_warmup(i, 0.02, 0.2, 300, kind), f"step {i}")


def test_warmup_lr_default_is_log_and_tiny_warmup():
    opt = _optimizer()
    WarmupLR(opt)
    assert opt.param_groups[0]["lr"] == 0.0
    for i, (lr,) in enumerate(_run(WarmupLR(_optimizer(), warmup_num_steps=1), 10)):
        _assert_close(lr, ref_warmup(i, n=1), f"step {i}")


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    for i, (lr,) in enumerate(_run(WarmupDecayLR(_optimizer(), 1500, warmup_type=kind))):
        _assert_close(lr, ref_warmup_decay(i, 1500, kind=kind), f"step {i}")
    assert _run(WarmupDecayLR(_optimizer(), 1500), STEPS)[-1] == [0.0]
    sched = WarmupDecayLR(_optimizer(groups=2), 1800, 1e-5, [1e-3, 2e-3], 100, kind)
    for i, lrs in enumerate(_run(sched)):
        _assert_close(lrs[1], ref_warmup_decay(i, 1800, 1e-5, 2e-3, 100, kind), f"step {i}")


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    opt = _optimizer(groups=2, lr=0.1)
    for i, lrs in enumerate(_run(WarmupCosineLR(opt, 1800, warmup_type=kind))):
        _assert_close(lrs[0], ref_cosine(i, 0.1, 1800, kind=kind), f"step {i}")
        _assert_close(lrs[1], ref_cosine(i, 0.2, 1800, kind=kind), f"step {i}")
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 1e-4)  # held at cos_min_ratio after the end
    opt = _optimizer(lr=0.5)
    for i, (lr,) in enumerate(_run(WarmupCosineLR(opt, 1000, 0.1, 200, 0.05, kind))):
        _assert_close(lr, ref_cosine(i, 0.5, 1000, 0.1, 200, 0.05, kind), f"step {i}")


def test_cosine_rebuild_keeps_original_lr():
    opt = _optimizer(lr=0.3)
    sched = WarmupCosineLR(opt, 100, warmup_num_steps=10)
    _run(sched, 20)
    again = WarmupCosineLR(opt, 100, warmup_num_steps=10, last_batch_iteration=19)
    assert again.org_lrs == [0.3] and again.get_lr() == sched.get_lr()


# ------------------------------------------------------------------------------ state dict round trips
_FACTORIES = {
    "LRRangeTest": lambda o: LRRangeTest(o, 1e-3, 100, 2.0, True),
    "OneCycle": lambda o: OneCycle(o, 1e-4, 1e-3, 0.1, 400, 300, 0, None, 20, True, 0.8, 0.9, 0.05),
    "WarmupLR": lambda o: WarmupLR(o, 0.0, 0.01, 500, "linear"),
    "WarmupDecayLR": lambda o: WarmupDecayLR(o, 1700, 1e-4, 0.01, 300),
    "WarmupCosineLR": lambda o: WarmupCosineLR(o, 1600, 0.05, 250),
}


@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_state_dict_json_round_trip(name):
    make = _FACTORIES[name]
    full = _run(make(_optimizer("adam", groups=2)))
    first = make(_optimizer("adam", groups=2))
    head = _run(first, 777)
    state = json.loads(json.dumps(first.state_dict()))
    # A fresh optimizer with other learning rates: the loaded state must win.
    opt = _optimizer("adam", groups=2, lr=0.7)
    resumed = make(opt)
    resumed.load_state_dict(state)
    assert [g["lr"] for g in opt.param_groups] == head[-1]
    assert head + _run(resumed, STEPS - 777) == full
    with pytest.raises(ValueError, match="state is of a"):
        (WarmupLR if name != "WarmupLR" else LRRangeTest)(_optimizer("adam", groups=2)).load_state_dict(state)


@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_schedule_drives_the_optimizer_after_its_load_state_dict(name):
    """torch's ``optimizer.load_state_dict`` replaces the param-group dicts: a schedule built before it
    kept writing its rates into the old ones, so the optimizer's lr (and momentum) stopped moving."""
    make = _FACTORIES[name]
    reference_opt = _optimizer("adam", groups=2)
    reference = make(reference_opt)
    opt = _optimizer("adam", groups=2)
    sched = make(opt)
    opt.load_state_dict(_optimizer("adam", groups=2).state_dict())
    for _ in range(300):
        reference.step()
        sched.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in reference_opt.param_groups]
        assert [g.get("betas") for g in opt.param_groups] == [
            g.get("betas") for g in reference_opt.param_groups
        ]


# ------------------------------------------------------------------------------ config and validation
def test_build_from_config_matches_direct_construction():
    cfg = {"type": "WarmupDecayLR", "params": {"total_num_steps": 900, "warmup_max_lr": 0.01,
                                               "warmup_num_steps": 100, "warmup_type": "linear"}}  # fmt: skip
    built = build_lr_scheduler(_optimizer(), cfg)
    assert isinstance(built, WarmupDecayLR)
    assert _run(built, 1000) == _run(WarmupDecayLR(_optimizer(), 900, 0.0, 0.01, 100, "linear"), 1000)
    for name in VALID_LR_SCHEDULES:
        params = {"total_num_steps": 5000} if name in ("WarmupDecayLR", "WarmupCosineLR") else {}
        if name == "OneCycle":
            params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}
        assert type(build_lr_scheduler(_optimizer(), {"type": name, "params": params})).__name__ == name
    assert isinstance(build_lr_scheduler(_optimizer(), {"type": "WarmupLR"}), WarmupLR)


def test_build_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown scheduler type 'Cyclic'.*WarmupCosineLR"):
        build_lr_scheduler(_optimizer(), {"type": "Cyclic", "params": {}})
    with pytest.raises(ValueError, match=r"unknown params \['warmup_maxlr'\] for WarmupLR"):
        build_lr_scheduler(_optimizer(), {"type": "WarmupLR", "params": {"warmup_maxlr": 1}})
    with pytest.raises(ValueError, match=r"requires params \['total_num_steps'\]"):
        build_lr_scheduler(_optimizer(), {"type": "WarmupCosineLR", "params": {}})
    with pytest.raises(ValueError, match="unknown keys"):
        build_lr_scheduler(_optimizer(), {"type": "WarmupLR", "param": {}})
    with pytest.raises(TypeError, match="must be a dict"):
        build_lr_scheduler(_optimizer(), "WarmupLR")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda o: WarmupLR(o, warmup_type="cosine"), r"'warmup_type' must be one of \['log', 'linear'\]"),
        (lambda o: WarmupLR(o, warmup_num_steps=-1), "'warmup_num_steps' must be >= 0"),
        (lambda o: WarmupLR(o, warmup_max_lr=[0.1, 0.2]), "has 2 values but the optimizer has 1"),
        (lambda o: WarmupLR(o, warmup_max_lr="0.1"), "'warmup_max_lr' must be a finite number"),
        (lambda o: LRRangeTest(o, lr_range_test_step_size=0), "'lr_range_test_step_size' must be >= 1"),
        (lambda o: LRRangeTest(o, lr_range_test_step_size=2.5), "'lr_range_test_step_size' must be an int"),
        (
            lambda o: OneCycle(o, 0.1, 0.2, cycle_first_stair_count=-1),
            "'cycle_first_stair_count' must be >= 0",
        ),
        (lambda o: WarmupDecayLR(o, 0), "'total_num_steps' must be >= 1"),
        (lambda o: WarmupCosineLR(o, 500), "must be greater than 'warmup_num_steps'"),
        (lambda o: WarmupLR(o, last_batch_iteration=-2), "'last_batch_iteration' must be >= -1"),
        (lambda o: WarmupLR(object()), "'optimizer' must be a torch optimizer"),
    ],
)
def test_argument_validation(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make(_optimizer())


def test_get_last_lr_and_resume_by_iteration():
    sched = WarmupLR(_optimizer(), warmup_num_steps=50)
    assert sched.get_last_lr() == [0.0]
    sched.step(last_batch_iteration=9)
    _assert_close(sched.get_last_lr()[0], ref_warmup(9, n=50), "jump")
    resumed = WarmupLR(_optimizer(), warmup_num_steps=50, last_batch_iteration=9)
    assert resumed.get_last_lr() == sched.get_last_lr()
