"""DeepSpeed users' configs and scripts, unchanged: Hjson config files, ``args.deepscale_config``,
keys DeepSpeed ignores inside known sections, ``checkpoint.tag_validation`` Warn/Ignore/Fail, and
OneCycle's ``get_mom()`` tuples."""

from __future__ import annotations

import argparse
import json
import os
import warnings

import pytest
import torch
import torch.nn as nn
from zero_core.config import ConfigError, load_config
from zero_core.testing import run_multirank

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}

HJSON = """
// a DeepSpeed config with Hjson's comments, unquoted keys and trailing commas
{
  train_micro_batch_size_per_gpu: 2,   # micro batch
  optimizer: {
    type: Adam
    params: {lr: 0.001, betas: [0.8, 0.999],},
  },
  /* ZeRO */
  zero_optimization: {stage: 2},
}
"""


def test_hjson_config_file_reads_as_deepspeed_reads_it(tmp_path):
    path = tmp_path / "ds_config.hjson"
    path.write_text(HJSON)
    cfg = load_config(str(path), world_size=1)
    same = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999]}}}
    want = load_config({**same, "zero_optimization": {"stage": 2}}, world_size=1)
    assert cfg.to_dict() == want.to_dict()
    assert isinstance(cfg.optimizer.params["lr"], float)


def test_file_neither_json_nor_hjson_names_both_errors(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "a": [1, 2}')
    with pytest.raises(ConfigError) as e:
        load_config(str(path), world_size=1)
    assert "not valid JSON" in str(e.value) and "not valid Hjson either" in str(e.value)


def test_hjson_duplicate_keys_are_rejected(tmp_path):
    path = tmp_path / "dup.hjson"
    path.write_text("{\n train_micro_batch_size_per_gpu: 2\n train_micro_batch_size_per_gpu: 4\n}")
    with pytest.raises(ConfigError, match="duplicate key"):
        load_config(str(path), world_size=1)


def test_deepscale_config_argument(tmp_path):
    from zero_core.arguments import add_config_arguments

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE))
    parser = add_config_arguments(argparse.ArgumentParser())
    assert "deepscale" not in parser.format_help()  # hidden, as in DeepSpeed
    args = parser.parse_args(["--deepscale", "--deepscale_config", str(path)])
    with pytest.warns(FutureWarning, match="deepscale_config is deprecated"):
        cfg = load_config(args=args, world_size=1)
    assert cfg.train_micro_batch_size_per_gpu == 2
    both = parser.parse_args(["--deepscale_config", str(path), "--deepspeed_config", str(path)])
    with pytest.raises(ConfigError, match="pass the config once"):
        load_config(args=both, world_size=1)


@pytest.mark.parametrize(
    ("section", "key", "meant"),
    [("flops_profiler", "step", "profile_step"), ("optimizer", "torch_adam", "optimizer.params")],
)
def test_keys_deepspeed_ignores_are_accepted_with_a_warning(section, key, meant):
    raw = {**BASE, "flops_profiler": {"enabled": False}}
    raw[section] = {**raw[section], key: 1 if key == "step" else True}
    with pytest.warns(UserWarning, match=rf"{section}\.{key} does nothing: .*{meant}"):
        cfg = load_config(raw, world_size=1)
    dumped = cfg.to_dict()[section]
    assert key not in dumped  # dropped: no section model or plugin sees it


def test_other_unknown_keys_in_those_sections_are_still_rejected():
    with pytest.raises(ConfigError, match="optimizer.torch_adams"):
        load_config({**BASE, "optimizer": {**BASE["optimizer"], "torch_adams": True}}, world_size=1)


def test_one_cycle_get_mom_returns_beta_pairs_per_group():
    from zero_core.lr_schedules import OneCycle

    w1, w2 = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([{"params": [w1]}, {"params": [w2], "betas": (0.9, 0.95)}], lr=1e-3)
    sched = OneCycle(opt, cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=4,
                     cycle_min_mom=0.85, cycle_max_mom=0.95)  # fmt: skip
    for _ in range(2):
        opt.step()
        sched.step()
    moms = sched.get_mom()
    assert [len(m) for m in moms] == [2, 2]
    assert [m[0] for m in moms] == [g["betas"][0] for g in opt.param_groups]
    assert moms[0][0] == pytest.approx(0.95 - 0.1 * 2 / 4)
    assert [m[1] for m in moms] == [0.999, 0.95]  # each group's own beta2
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    s2 = OneCycle(sgd, cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=4)
    assert s2.get_mom() == [(sgd.param_groups[0]["momentum"], 0.99)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(x).pow(2).mean()


def _save_with_rank_tags(tmp: str) -> dict:
    import torch.distributed as dist
    import zero_core
    from zero_core.checkpoint.format import CheckpointError

    rank = dist.get_rank()
    out = {}
    for mode in ("Warn", "Ignore", "Fail"):
        torch.manual_seed(0)
        cfg = {**BASE, "checkpoint": {"tag_validation": mode}, "steps_per_print": 10**6}
        engine, *_ = zero_core.initialize(model=Net(), config=cfg)
        save_dir = os.path.join(tmp, mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine.save_checkpoint(save_dir, tag=f"tag-{rank}")
                err = None
            except CheckpointError as e:
                err = str(e)
        dist.barrier()
        loaded = None
        if err is None:
            path, _ = engine.load_checkpoint(save_dir)
            loaded = os.path.basename(str(path).rstrip("/"))
        out[mode] = (err, [str(w.message) for w in caught if "different tags" in str(w.message)], loaded)
    return out


def test_checkpoint_tag_validation_modes(tmp_path):
    for res in run_multirank(_save_with_rank_tags, 2, args=(str(tmp_path),), timeout=240):
        err, warned, loaded = res["Warn"]
        assert err is None and len(warned) == 1 and "saving under rank 0's tag 'tag-0'" in warned[0]
        assert loaded == "tag-0"
        err, warned, loaded = res["Ignore"]
        assert err is None and warned == [] and loaded == "tag-0"
        err, warned, loaded = res["Fail"]
        assert err is not None and "different tags" in err and 'tag_validation is "Fail"' in err
    assert sorted(os.listdir(tmp_path / "Warn")) == sorted(os.listdir(tmp_path / "Ignore"))
    assert "tag-1" not in os.listdir(tmp_path / "Warn")
