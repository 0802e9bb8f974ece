"""Config sources: dict, JSON file path (str and Path), JSON text, argparse Namespace, ZeroConfig;
JSON reading errors; to_dict round trip."""

from __future__ import annotations

import argparse
import json

import pytest
from zero_core.config import ConfigError, ZeroConfig, load_config


@pytest.fixture(autouse=True)
def builtin_sections_only(monkeypatch):
    """Pin zero-core's own built-in section models: packages installed alongside (zero-pipe
    registers a strict ``pipeline`` model) must not change what these tests check."""
    from zero_core.config import sections

    monkeypatch.setattr(sections, "_entry_points", {})


CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "stage3_max_live_parameters": 1e6},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
    "activation_checkpointing": {
        "partition_activations": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 4,
    },
    "tensorboard": {"enabled": True, "output_path": "/tmp/tb", "job_name": "j"},
    "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]},
    "flops_profiler": {"enabled": True, "profile_step": 3},
    "pipeline": {"stages": 2, "custom_key": 1},
    "checkpoint": {"tag_validation": "Ignore"},
    "gradient_clipping": 0.0,
}


@pytest.fixture
def json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def check(cfg: ZeroConfig) -> None:
    assert isinstance(cfg, ZeroConfig)
    assert cfg.zero_optimization.stage == 3
    assert cfg.zero_optimization.max_live_parameters == 1_000_000
    assert cfg.gradient_accumulation_steps == 2
    assert cfg.bf16.enabled and cfg.gradient_clipping == 0.0
    assert cfg.pipeline.stages == 2 and cfg.pipeline.custom_key == 1
    assert cfg.flops_profiler.profile_step == 3


def test_dict(json_file):
    check(load_config(CONFIG, world_size=2))


@pytest.mark.parametrize("as_str", [True, False])
def test_json_file_path(json_file, as_str):
    check(load_config(str(json_file) if as_str else json_file, world_size=2))


def test_json_text():
    check(load_config(json.dumps(CONFIG), world_size=2))


def test_config_params_old_name():
    check(load_config(config_params=CONFIG, world_size=2))


@pytest.mark.parametrize("attr", ["zero_config", "deepspeed_config", "deepspeed"])
def test_argparse_namespace(json_file, attr):
    args = argparse.Namespace(local_rank=0, **{attr: str(json_file)})
    check(load_config(args=args, world_size=2))


def test_argparse_parser_with_boolean_deepspeed_flag(json_file):
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--deepspeed_config", type=str)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(json_file)])
    check(load_config(args=args, world_size=2))


def test_config_given_twice_is_an_error(json_file):
    args = argparse.Namespace(deepspeed_config=str(json_file))
    with pytest.raises(ConfigError, match="given both to load_config and in args.deepspeed_config"):
        load_config(CONFIG, args=args)
    with pytest.raises(ConfigError, match="config and config_params are both given"):
        load_config(CONFIG, config_params=dict(CONFIG))


def test_no_config():
    with pytest.raises(ConfigError, match="no config given"):
        load_config()
    with pytest.raises(ConfigError, match="no config given"):
        load_config(args=argparse.Namespace(deepspeed=True))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.json")


def test_bad_source_type():
    with pytest.raises(
        ConfigError, match="expected a dict, a path to a JSON file, JSON text or a ZeroConfig, got int"
    ):
        load_config(42)


def test_invalid_json_names_file_and_position(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8,\n "fp16": {"enabled": tru}}')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "line 2" in str(info.value)


def test_duplicate_keys_rejected(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError, match="stage: duplicate key"):
        load_config(path)


def test_top_level_must_be_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        load_config(path)


def test_errors_name_the_file(json_file):
    json_file.write_text(json.dumps({**CONFIG, "gradient_clipp1ng": 1}))
    with pytest.raises(ConfigError) as info:
        load_config(json_file, world_size=2)
    assert str(json_file) in str(info.value) and "did you mean gradient_clipping?" in str(info.value)


def test_round_trip_through_json(tmp_path):
    cfg = load_config(CONFIG, world_size=2)
    path = tmp_path / "out.json"
    path.write_text(json.dumps(cfg.to_dict()))
    again = load_config(path, world_size=2)
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()


def test_zero_config_passthrough():
    cfg = load_config(CONFIG, resolve_batch=False)
    resolved = load_config(cfg, world_size=2)
    assert resolved.gradient_accumulation_steps == 2 and cfg.gradient_accumulation_steps is None


def test_input_dict_not_modified():
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 3, "cpu_offload": True}}
    snapshot = json.dumps(config, sort_keys=True)
    with pytest.warns(FutureWarning):
        load_config(config)
    assert json.dumps(config, sort_keys=True) == snapshot


def test_every_top_level_key_of_the_reference():
    config = {
        "train_batch_size": 8,
        "steps_per_print": 5,
        "wall_clock_breakdown": True,
        "dump_state": True,
        "memory_breakdown": True,
        "prescale_gradients": True,
        "gradient_predivide_factor": 2.0,
        "sparse_gradients": True,
        "communication_data_type": "bf16",
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "fp16": {
            "enabled": True,
            "auto_cast": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 100,
            "hysteresis": 3,
            "consecutive_hysteresis": True,
            "min_loss_scale": 2,
        },
        "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
        "csv_monitor": {"enabled": True, "output_path": "out", "job_name": "job"},
        "comms_logger": {
            "enabled": True,
            "verbose": True,
            "prof_all": False,
            "debug": True,
            "prof_ops": ["all_gather"],
        },
        "aio": {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 2,
            "single_submit": True,
            "overlap_events": False,
        },
        "autotuning": {"enabled": True, "fast": False, "metric": "latency", "tuner_type": "random"},
        # switched off: zero does not implement elasticity or data efficiency (see
        # test_config_unimplemented.py); their keys are still parsed and typed.
        "elasticity": {
            "enabled": False,
            "max_train_batch_size": 64,
            "micro_batch_sizes": [1, 2],
            "min_gpus": 1,
            "max_gpus": 8,
        },
        "data_efficiency": {"enabled": False, "seed": 1234, "data_sampling": {"enabled": True}},
        # the moe section configures nothing (MoE layers take their settings in code): its keys
        # are errors when set, see test_config_truth.py
        "moe": {"enabled": False},
    }
    cfg = load_config(config, world_size=1)
    assert cfg.steps_per_print == 5 and cfg.gradient_predivide_factor == 2.0
    assert cfg.communication_data_type == "bf16" and not cfg.zero_force_ds_cpu_optimizer
    assert cfg.fp16.dynamic_loss_scale and cfg.fp16.initial_dynamic_scale == 4096.0
    assert (
        cfg.wandb.project == "p"
        and cfg.csv_monitor.job_name == "job"
        and cfg.comms_logger.prof_ops == ["all_gather"]
    )
    assert cfg.aio.queue_depth == 32 and cfg.autotuning.tuner_type == "random"
    assert cfg.elasticity.micro_batch_sizes == [1, 2] and cfg.data_efficiency.seed == 1234
    assert cfg.moe.enabled is False
    assert load_config(cfg.to_dict(), world_size=1) == cfg
