"""``zero.checkpoint.from_deepspeed``: DeepSpeed checkpoints continue under zero as under DeepSpeed.

The fixtures under ``fixtures/deepspeed/`` were written by DeepSpeed 0.19.8 on CPU
(``tools/make_deepspeed_fixtures.py``, which records the version, config and command beside
each): a small model trained 3 steps and saved, then DeepSpeed's own losses for 5 more steps
after loading that checkpoint. Each test converts a fixture and continues it with zero on the
same batches; no DeepSpeed is needed here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import zero_core
from zero_core import comm
from zero_core.checkpoint import CheckpointError, from_deepspeed
from zero_core.checkpoint.deepspeed_import.safe_pickle import load_deepspeed_file
from zero_core.checkpoint.deepspeed_import.stage0 import assign_groups, stage0_fragments
from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zero_core.testing import run_multirank

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("ds_fixture_model", FIXTURES / "fixture_model.py")
fm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fm)

#: fp32 continues within float rounding at any world size; 16-bit runs at another world size compute
#: other 16-bit gradients (another batch split and reduction), so they agree to 16-bit precision only.
TOL_EXACT = 1e-5
TOL_16BIT_RESHARDED = 2e-3


def _record(variant: str) -> dict:
    return json.loads((FIXTURES / f"{variant}.json").read_text())


def _group_names(kind: str = "plain") -> list[list[str]]:
    """The parameter names of each of ``fixture_model.param_groups``'s groups."""
    model = fm.build_model(kind=kind)
    return [
        [n for n, p in model.named_parameters() if any(p is q for q in g["params"])]
        for g in fm.param_groups(model)
    ]


def _convert(variant: str, tmp_path: Path, **kw) -> str:
    out = tmp_path / f"zero_{variant}"
    rec = _record(variant)
    if rec["zero_stage"] == 0 and rec.get("model_kind") == "tied_frozen":
        # a frozen parameter fits a group's next shape too: the groups cannot be told from shapes
        kw.setdefault("param_groups", _group_names("tied_frozen"))
    from_deepspeed(FIXTURES / variant, out, **kw)
    return str(out)


def _continue(ckpt: str, cfg: dict, world: int, kind: str) -> list[float]:
    """One rank: a fresh model, the converted checkpoint loaded, the next 5 batches; mean losses."""
    rank = comm.get_rank() if comm.is_initialized() else 0
    model = fm.build_model(seed=4321, kind=kind)  # not the saved weights: the load must bring them
    engine, *_ = zero_core.initialize(model=model, model_parameters=fm.param_groups(model), config=cfg)
    engine.load_checkpoint(ckpt)
    losses = []
    for step in range(fm.STEPS_BEFORE_SAVE, fm.STEPS_BEFORE_SAVE + fm.STEPS_AFTER_LOAD):
        x, y = fm.rank_batch(step, rank, world)
        loss = fm.loss_fn(engine(x.to(engine.compute_dtype)), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
        losses.append(float(mean / world))
    return losses


def _zero_losses(ckpt: str, variant: str, world: int | None = None, stage: int | None = None) -> list[float]:
    rec = _record(variant)
    world = world or rec["world_size"]
    cfg = json.loads(json.dumps(rec["config"]))
    cfg["train_micro_batch_size_per_gpu"] = fm.GLOBAL_BATCH // world
    if stage is not None:
        cfg["zero_optimization"]["stage"] = stage
    _reduce_wide_sums_as_deepspeed(cfg)
    return run_multirank(
        _continue, world_size=world, args=(ckpt, cfg, world, rec.get("model_kind", "plain")), timeout=300
    )[0]


def _reduce_wide_sums_as_deepspeed(cfg: dict) -> None:
    """At stages 0-1 zero reduces fp32-accumulated gradients in fp32 unless
    ``communication_data_type`` is set; DeepSpeed reduces them in the model's dtype (a deliberate
    difference, see [Note: gradient accumulation dtype] and the README). Ask for DeepSpeed's."""
    wide = cfg.get("data_types", {}).get("grad_accum_dtype") in ("fp32", "float32")
    model = (
        "bf16"
        if cfg.get("bf16", {}).get("enabled")
        else "fp16"
        if cfg.get("fp16", {}).get("enabled")
        else None
    )
    if wide and model and cfg["zero_optimization"].get("stage", 0) <= 1:
        cfg.setdefault("communication_data_type", model)


def _max_diff(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) == fm.STEPS_AFTER_LOAD
    return max(abs(a - b) for a, b in zip(got, want))


SAME_LAYOUT = [
    "stage0_fp32_ws2",
    "stage0_bf16_ws2",
    "stage1_fp32_ws2",
    "stage1_bf16_ws2",
    "stage1_bf16acc32_ws2",
    "stage2_fp32_ws1",
    "stage2_fp32_ws2",
    "stage2_bf16_ws2",
    "stage2_fp16_ws2",
    "stage3_fp32_ws1",
    "stage3_fp32_ws2",
    "stage3_bf16_ws2",
    "stage0_tiedfrozen_ws1",
    "stage2_tiedfrozen_ws2",
    "stage3_tiedfrozen_ws2",
]


@pytest.mark.parametrize("variant", SAME_LAYOUT)
def test_continues_as_deepspeed_did(variant: str, tmp_path: Path) -> None:
    """Same world size and stage as saved: zero's 5 losses equal DeepSpeed's (1e-5)."""
    rec = _record(variant)
    assert rec["deepspeed_version"] == "0.19.8"
    got = _zero_losses(_convert(variant, tmp_path), variant)
    assert _max_diff(got, rec["losses_after_load"]) <= TOL_EXACT, (got, rec["losses_after_load"])


ANOTHER_LAYOUT = [  # (fixture, zero world size, zero stage or None for the saved one)
    ("stage0_fp32_ws2", 1, None),
    ("stage1_fp32_ws2", 4, 3),
    ("stage2_fp32_ws1", 2, None),
    ("stage2_fp32_ws2", 4, 1),
    ("stage3_fp32_ws2", 1, 2),
    ("stage3_fp32_ws1", 4, None),
    ("stage2_bf16_ws2", 1, None),
    ("stage3_bf16_ws2", 4, 2),
    ("stage2_fp16_ws2", 1, 3),
    ("stage2_tiedfrozen_ws2", 1, 3),
    ("stage3_tiedfrozen_ws2", 4, 1),
]


@pytest.mark.parametrize(("variant", "world", "stage"), ANOTHER_LAYOUT)
def test_continues_at_another_world_size_and_stage(
    variant: str, world: int, stage: int | None, tmp_path: Path
) -> None:
    rec = _record(variant)
    got = _zero_losses(_convert(variant, tmp_path), variant, world, stage)
    tol = TOL_EXACT if rec["precision"] == "fp32" else TOL_16BIT_RESHARDED
    assert _max_diff(got, rec["losses_after_load"]) <= tol, (got, rec["losses_after_load"])


def test_stage0_fp16_state_is_deepspeeds(tmp_path: Path) -> None:
    """DeepSpeed 0.19.8's stage 0 fp16 optimizer (FP16_UnfusedOptimizer): the loaded state is DeepSpeed's.

    Its later losses are not compared: that optimizer's update differs from zero's fp16 update
    (its Adam moments are ~1/130 of those the same run holds at stage 2, and from the same
    initial weights its step-1 loss already differs from zero's), which is training math, not
    the checkpoint. The weights, masters, moments, step counts, learning rate and loss scale
    after the load are DeepSpeed's, and so is the first loss.
    """
    ckpt = _convert("stage0_fp16_ws1", tmp_path)
    # an engine in one forked rank: the test process keeps no process group (see run_multirank)
    assert run_multirank(_check_stage0_fp16_state, 1, args=(ckpt,), timeout=300) == [True]


def _check_stage0_fp16_state(ckpt: str) -> bool:
    saved = load_deepspeed_file(
        str(FIXTURES / "stage0_fp16_ws1" / "global_step3" / "mp_rank_00_model_states.pt")
    )
    cfg = _record("stage0_fp16_ws1")["config"]
    model = fm.build_model(seed=4321)
    engine, *_ = zero_core.initialize(model=model, model_parameters=fm.param_groups(model), config=cfg)
    engine.load_checkpoint(ckpt)
    opt = saved["optimizer"]
    masters = [m for g in opt["fp32_groups"] for m in g]
    states = [opt["optimizer_state_dict"]["state"][i] for i in range(len(masters))]
    live = [p for g in engine.optimizer.param_groups for p in g["params"]]
    assert len(live) == len(masters)
    for p, m, st in zip(live, masters, states):
        assert torch.equal(p.detach(), m)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(engine.optimizer.state[p][key], st[key])
        assert float(engine.optimizer.state[p]["step"]) == float(st["step"]) == 4.0
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved["module"][name])
    lr = opt["optimizer_state_dict"]["param_groups"][0]["lr"]
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12)
    assert engine.loss_scaler.state_dict()["cur_scale"] == opt["cur_scale"] == 256.0
    assert engine.loss_scaler.state_dict()["cur_iter"] == opt["cur_iter"] == 3
    x, y = fm.rank_batch(fm.STEPS_BEFORE_SAVE, 0, 1)
    first = fm.loss_fn(engine(x.to(engine.compute_dtype)), y).item()
    assert first == pytest.approx(_record("stage0_fp16_ws1")["losses_after_load"][0], abs=TOL_EXACT)
    return True


def test_engine_state_is_carried(tmp_path: Path) -> None:
    """Counters, LR scheduler, param groups and the dynamic loss scaler of a ZeRO-2 fp16 run."""
    ckpt = _convert("stage2_fp16_ws2", tmp_path)
    meta = json.loads((Path(ckpt) / "global_step3" / "checkpoint.json").read_text())
    tag_dir = FIXTURES / "stage2_fp16_ws2" / "global_step3"
    states = load_deepspeed_file(str(tag_dir / "mp_rank_00_model_states.pt"))
    osd = load_deepspeed_file(str(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))[
        "optimizer_state_dict"
    ]
    scaler = osd["loss_scaler"].fields()
    assert meta["loss_scaler"] == {
        "cur_scale": scaler["cur_scale"],
        "cur_iter": scaler["cur_iter"],
        "last_overflow_iter": scaler["last_overflow_iter"],
        "cur_hysteresis": scaler["cur_hysteresis"],
        "overflows": 0,
    }
    assert scaler["cur_scale"] == 256.0 and scaler["cur_iter"] == 3
    assert (meta["global_steps"], meta["global_samples"], meta["skipped_steps"]) == (3, 24, 0)
    assert meta["lr_scheduler"] == states["lr_scheduler"] == {"last_batch_iteration": 2}
    saved_groups = osd["base_optimizer_state"]["param_groups"]
    assert [g["weight_decay"] for g in meta["optimizer"]["param_groups"]] == [0.05, 0.0]
    assert [g["lr"] for g in meta["optimizer"]["param_groups"]] == [g["lr"] for g in saved_groups]
    assert (meta["world_size"], meta["zero_stage"], meta["compute_dtype"]) == (2, 2, "float16")
    assert meta["imported_from"]["deepspeed_version"] == "0.19.8"


def test_partitions_of_every_stage_give_the_same_weights(tmp_path: Path) -> None:
    """The fp32 runs of stages 0-3 (the same training) reassemble to the same weights."""
    sds = {
        v: get_fp32_state_dict_from_zero_checkpoint(_convert(v, tmp_path))
        for v in (
            "stage0_fp32_ws2",
            "stage1_fp32_ws2",
            "stage2_fp32_ws2",
            "stage3_fp32_ws2",
            "stage3_fp32_ws1",
        )
    }
    ref = sds.pop("stage0_fp32_ws2")
    assert set(ref) == {
        "fc1.weight",
        "fc1.bias",
        "norm.weight",
        "norm.bias",
        "fc2.weight",
        "fc2.bias",
        "out_scale",
    }
    for sd in sds.values():
        assert set(sd) == set(ref)
        for k in ref:
            torch.testing.assert_close(sd[k], ref[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "variant", ["stage0_tiedfrozen_ws1", "stage2_tiedfrozen_ws2", "stage3_tiedfrozen_ws2"]
)
def test_tied_and_frozen_parameters_are_carried(variant: str, tmp_path: Path) -> None:
    """The tied pair is stored once and named as a pair; the frozen weight (stage 3: its shards) is there."""
    ckpt = _convert(variant, tmp_path)
    meta = json.loads((Path(ckpt) / "global_step3" / "checkpoint.json").read_text())
    assert meta["shared_parameters"] == [["tail.weight", "head.weight"]]
    trained = {n: t for n, t, _ in meta["parameters"]}
    assert trained["norm.weight"] is False and trained["head.weight"] is True and "tail.weight" not in trained
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert torch.equal(sd["tail.weight"], sd["head.weight"])
    initial = fm.build_model(kind="tied_frozen").norm.weight.detach()
    assert torch.equal(sd["norm.weight"], initial.float())  # frozen: still its initial value


def _touch(path: str) -> None:
    Path(path).write_text("ran")


class _Planted:
    """Unpickling this runs ``_touch``: what a hostile checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


def test_a_file_holding_another_class_is_refused_without_running_it(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(FIXTURES / "stage2_fp32_ws2", ds)
    victim = ds / "global_step3" / "mp_rank_00_model_states.pt"
    marker = tmp_path / "pwned"
    sd = torch.load(victim, weights_only=True)  # tensors and dicts only
    sd["planted"] = _Planted(str(marker))
    torch.save(sd, victim)
    with pytest.raises(CheckpointError) as e:
        from_deepspeed(ds, tmp_path / "out")
    assert f"{__name__}._touch" in str(e.value) and "nothing in it was run" in str(e.value)
    assert not marker.exists()
    assert not (tmp_path / "out" / "global_step3").exists()  # nothing published
    torch.load(victim, weights_only=False)  # control: a plain load does run it
    assert marker.read_text() == "ran"


def _load_deepspeed_folder() -> str:
    model = fm.build_model()
    engine, *_ = zero_core.initialize(
        model=model, config={"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    )
    with pytest.raises(CheckpointError, match=r"is a DeepSpeed checkpoint.*tools/from_deepspeed.py") as e:
        engine.load_checkpoint(str(FIXTURES / "stage2_fp32_ws2"))
    return str(e.value)


def test_engine_load_checkpoint_on_a_deepspeed_folder_says_to_convert() -> None:
    (msg,) = run_multirank(_load_deepspeed_folder, 1, timeout=300)
    assert "zero.checkpoint.from_deepspeed" in msg and "any world size" in msg


def test_incomplete_and_unsupported_folders_are_refused(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(FIXTURES / "stage3_fp32_ws2", ds)
    with pytest.raises(CheckpointError, match="own directory"):
        from_deepspeed(ds, ds)
    (ds / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"ranks \[1\] are missing|incomplete"):
        from_deepspeed(ds, tmp_path / "out")
    tp = tmp_path / "tp"
    shutil.copytree(FIXTURES / "stage2_fp32_ws1", tp)
    shutil.copy(
        tp / "global_step3" / "mp_rank_00_model_states.pt", tp / "global_step3" / "mp_rank_01_model_states.pt"
    )
    with pytest.raises(CheckpointError, match="tensor-parallel"):
        from_deepspeed(tp, tmp_path / "out")
    with pytest.raises(CheckpointError, match="does not exist"):
        from_deepspeed(FIXTURES / "stage2_fp32_ws1", tmp_path / "out", tag="global_step9")
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / "stage2_fp32_ws1", bad)
    path = bad / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[:-500])  # truncated
    with pytest.raises(CheckpointError, match="zero_pp_rank_0"):
        from_deepspeed(bad, tmp_path / "out")
    assert not (tmp_path / "out" / "global_step3").exists()


def test_a_tag_directory_and_another_tag_name(tmp_path: Path) -> None:
    tag_dir = FIXTURES / "stage2_fp32_ws1" / "global_step3"
    out = from_deepspeed(tag_dir, tmp_path / "out", out_tag="from_ds")
    assert out == str(tmp_path / "out" / "from_ds") and (tmp_path / "out" / "latest").read_text() == "from_ds"
    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "out"))
    ref = get_fp32_state_dict_from_zero_checkpoint(_convert("stage2_fp32_ws1", tmp_path))
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


def test_stage0_groups_inferred_from_shapes_or_given(tmp_path: Path) -> None:
    names = _group_names()
    inferred = get_fp32_state_dict_from_zero_checkpoint(_convert("stage0_bf16_ws2", tmp_path))
    given = get_fp32_state_dict_from_zero_checkpoint(
        _convert("stage0_bf16_ws2", tmp_path / "given", param_groups=names)
    )
    for k in inferred:
        assert torch.equal(inferred[k], given[k])
    shapes = {"a": (4,), "b": (4,), "c": (2, 2)}
    with pytest.raises(CheckpointError, match="cannot tell which optimizer param group 'a'"):
        assign_groups(shapes, [[(4,)], [(4,), (2, 2)]], None, "x")
    assert assign_groups(shapes, [[(4,)], [(4,), (2, 2)]], [["b"], ["a", "c"]], "x") == [["b"], ["a", "c"]]
    with pytest.raises(CheckpointError, match="puts 'c'"):
        assign_groups(shapes, [[(4,)], [(4,), (2, 2)]], [["a"], ["c", "b"]], "x")
    with pytest.raises(
        CheckpointError, match="cannot tell which optimizer param group 'fc1.weight'.*none \\(frozen\\)"
    ):
        _convert("stage0_tiedfrozen_ws1", tmp_path / "frozen", param_groups=None)
    with pytest.raises(CheckpointError, match="param_groups is for stage 0"):
        _convert("stage2_fp32_ws1", tmp_path / "s2", param_groups=names)


def test_fused_fp16_optimizer_layout() -> None:
    """The fused fp16 wrapper (one flat fp32 master and state per group, no names): slices per parameter."""
    shapes = {"w": (2, 3), "b": (3,)}
    module = {"w": torch.arange(6.0).view(2, 3).half(), "b": torch.ones(3).half()}
    flat = torch.arange(9.0) / 10
    opt = {
        "dynamic_loss_scale": True,
        "cur_scale": 1024.0,
        "cur_iter": 7,
        "last_overflow_iter": 2,
        "optimizer_state_dict": {
            "state": {0: {"step": 5, "exp_avg": flat * 2, "exp_avg_sq": flat * 3}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "fp32_groups_flat": [flat],
    }
    frags, hyper, fields, trained = stage0_fragments(module, shapes, opt, None, "x")
    got = {(f.name, f.kind): f.tensor for f in frags}
    assert torch.equal(got[("w", "fp32")], flat[:6]) and torch.equal(got[("b", "fp32")], flat[6:])
    assert torch.equal(got[("b", "optim.exp_avg_sq")], flat[6:] * 3)
    assert got[("w", "optim.step")].dtype == torch.float32 and float(got[("w", "optim.step")]) == 5.0
    assert torch.equal(got[("w", "param")], module["w"].reshape(-1))
    assert fields["cur_scale"] == 1024.0 and trained == {"w", "b"} and hyper[0]["lr"] == 0.1
    with pytest.raises(CheckpointError, match="10 elements, its flat master has 9"):
        stage0_fragments({**module, "b": torch.ones(4).half()}, {"w": (2, 3), "b": (4,)}, opt, None, "x")


def test_command_line_tool(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "from_deepspeed.py"),
            str(FIXTURES / "stage3_bf16_ws2"),
            str(out),
            "--tag",
            "global_step3",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "[2/2] wrote rank_00001.safetensors" in run.stderr
    assert (out / "latest").read_text() == "global_step3"
    sd = get_fp32_state_dict_from_zero_checkpoint(str(out))
    assert sd["fc1.weight"].shape == (10, 6) and sd["fc1.weight"].dtype == torch.float32
    bad = subprocess.run(
        [sys.executable, str(REPO / "tools" / "from_deepspeed.py"), str(tmp_path / "nope"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 1 and "is not a directory" in bad.stderr


def test_fixtures_are_small_and_recorded() -> None:
    """The committed fixtures stay small, and each records what wrote it."""
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert total < 450_000
    for rec_path in FIXTURES.glob("*.json"):
        rec = json.loads(rec_path.read_text())
        assert (
            rec["deepspeed_version"]
            and rec["command"]
            and rec["config"]["zero_optimization"]["stage"] == rec["zero_stage"]
        )
        assert all(math.isfinite(x) for x in rec["losses_after_load"])
        for pt in (FIXTURES / rec["variant"]).rglob("*.pt"):
            assert zipfile.is_zipfile(pt)
