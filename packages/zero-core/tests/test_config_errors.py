"""Bad configs: each must fail with a message naming the key path, the value and what is allowed."""

from __future__ import annotations

import warnings

import pytest
from zero_core.config import ConfigError, load_config

BASE = {"train_batch_size": 8}


def cfg(**sections):
    return {**BASE, **sections}


# (id, config, expected substrings of the error message)
BAD_CONFIGS = [
    ("stage-5", cfg(zero_optimization={"stage": 5}), ["zero_optimization.stage: 5 is not one of 0, 1, 2, 3"]),
    (
        "stage-str",
        cfg(zero_optimization={"stage": "three"}),
        ["zero_optimization.stage", '"three"', "not an integer"],
    ),
    ("batch-str", {"train_batch_size": "abc"}, ['train_batch_size: "abc" is not an integer']),
    ("batch-negative", {"train_batch_size": -4}, ["train_batch_size: -4 is out of range: must be >= 1"]),
    ("batch-bool", {"train_batch_size": True}, ["train_batch_size: true is a boolean, expected a number"]),
    ("batch-fraction", {"train_batch_size": 8.5}, ["train_batch_size: 8.5 is not a whole number"]),
    (
        "micro-zero",
        {"train_micro_batch_size_per_gpu": 0},
        ["train_micro_batch_size_per_gpu: 0 is out of range"],
    ),
    (
        "typo-top",
        cfg(gradient_clipp1ng=1.0),
        ["gradient_clipp1ng: unknown key, did you mean gradient_clipping?"],
    ),
    (
        "typo-nested",
        cfg(zero_optimization={"stage": 2, "overlap_com": True}),
        ["zero_optimization.overlap_com: unknown key, did you mean overlap_comm?"],
    ),
    (
        "typo-deep",
        cfg(zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}),
        ["zero_optimization.offload_param.pin_memroy: unknown key, did you mean pin_memory?"],
    ),
    (
        "typo-fp16",
        cfg(fp16={"enabled": True, "loss_scale_windo": 10}),
        ["fp16.loss_scale_windo: unknown key, did you mean loss_scale_window?"],
    ),
    (
        "fp16-and-bf16",
        cfg(fp16={"enabled": True}, bf16={"enabled": True}),
        ["fp16.enabled and bf16.enabled are both true"],
    ),
    ("amp-and-fp16", cfg(fp16={"enabled": True}, amp={"enabled": True}), ["amp.enabled and fp16.enabled"]),
    (
        "amp-with-zero",
        cfg(amp={"enabled": True, "opt_level": "O1"}, zero_optimization={"stage": 2}),
        ["Apex AMP cannot be combined with ZeRO", "stage is 2"],
    ),
    (
        "offload-param-nvme-no-path-stage2",
        cfg(zero_optimization={"stage": 2, "offload_param": {"device": "nvme"}}),
        ['zero_optimization.offload_param.nvme_path: required when device is "nvme"'],
    ),
    (
        "offload-opt-stage0",
        cfg(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}),
        ["zero_optimization.offload_optimizer", "needs stage 1, 2 or 3, got stage 0"],
    ),
    (
        "offload-device",
        cfg(zero_optimization={"stage": 3, "offload_param": {"device": "gpu"}}),
        ['zero_optimization.offload_param.device: "gpu" is not one of "none", "cpu", "nvme"'],
    ),
    (
        "nvme-no-path",
        cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}}),
        ['zero_optimization.offload_optimizer.nvme_path: required when device is "nvme"'],
    ),
    (
        "offload-ratio",
        cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}),
        ["zero_optimization.offload_optimizer.ratio: 1.5 is out of range: must be <= 1"],
    ),
    (
        "bucket-negative",
        cfg(zero_optimization={"stage": 2, "reduce_bucket_size": -1}),
        ["zero_optimization.reduce_bucket_size: -1 is out of range: must be >= 0"],
    ),
    (
        "mics-stage2",
        cfg(zero_optimization={"stage": 2, "mics_shard_size": 8}),
        ["zero_optimization.mics_shard_size: MiCS needs stage 3, got stage 2"],
    ),
    (
        "mics-zero",
        cfg(zero_optimization={"stage": 3, "mics_shard_size": 0}),
        ["zero_optimization.mics_shard_size: 0 is out of range"],
    ),
    (
        "hpz-stage1",
        cfg(zero_optimization={"stage": 1, "zero_hpz_partition_size": 2}),
        ["zero_optimization.zero_hpz_partition_size", "needs stage 3"],
    ),
    ("section-not-object", cfg(zero_optimization=[1, 2]), ["zero_optimization: [1, 2] is not an object"]),
    ("bool-not-bool", cfg(fp16={"enabled": "maybe"}), ['fp16.enabled: "maybe" is not a boolean']),
    (
        "clipping-negative",
        cfg(gradient_clipping=-1.0),
        ["gradient_clipping: -1.0 is out of range: must be >= 0"],
    ),
    (
        "predivide-zero",
        cfg(gradient_predivide_factor=0),
        ["gradient_predivide_factor: 0 is out of range: must be > 0"],
    ),
    (
        "comm-dtype",
        cfg(communication_data_type="int8"),
        ['communication_data_type: "int8" is not one of "fp16", "bf16", "fp32"'],
    ),
    (
        "optimizer-type",
        cfg(optimizer={"type": "AdamX", "params": {"lr": 1e-3}}),
        ['optimizer.type: "AdamX": unknown optimizer, did you mean'],
    ),
    (
        "optimizer-betas",
        cfg(optimizer={"type": "AdamW", "params": {"betas": [0.9]}}),
        ["optimizer.params.betas: [0.9] must be two numbers in [0, 1)"],
    ),
    (
        "optimizer-lr",
        cfg(optimizer={"type": "Adam", "params": {"lr": "fast"}}),
        ['optimizer.params.lr: "fast" must be a number >= 0'],
    ),
    (
        "optimizer-no-type",
        cfg(optimizer={"params": {"lr": 1e-3}}),
        ["optimizer.type: required key is missing"],
    ),
    (
        "scheduler-type",
        cfg(scheduler={"type": "WarmupLinearLR"}),
        ['scheduler.type: "WarmupLinearLR": unknown scheduler, did you mean'],
    ),
    (
        "scheduler-param-typo",
        cfg(scheduler={"type": "WarmupLR", "params": {"warmup_max_l": 0.1}}),
        ["scheduler.params.warmup_max_l: unknown key, did you mean warmup_max_lr?"],
    ),
    (
        "scheduler-missing",
        cfg(scheduler={"type": "WarmupDecayLR", "params": {}}),
        ["scheduler.params.total_num_steps: required key is missing (needed by WarmupDecayLR)"],
    ),
    (
        "scheduler-auto-required",
        cfg(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}),
        ['scheduler.params.total_num_steps: "auto" cannot be resolved here'],
    ),
    (
        "scheduler-warmup-type",
        cfg(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cubic"}}),
        ['scheduler.params.warmup_type: "cubic" is not one of "log", "linear"'],
    ),
    (
        "scheduler-param-type",
        cfg(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": "many"}}),
        ['scheduler.params.warmup_num_steps: "many" is not an integer'],
    ),
    (
        "act-ckpt-contiguous-unpartitioned",
        cfg(activation_checkpointing={"contiguous_memory_optimization": True}),
        [
            "activation_checkpointing.contiguous_memory_optimization: works only with partition_activations: true"
        ],
    ),
    (
        "tag-validation",
        cfg(checkpoint={"tag_validation": "Maybe"}),
        ['checkpoint.tag_validation: "Maybe" is not one of "Ignore", "Warn", "Fail"'],
    ),
    ("pipeline-stages", cfg(pipeline={"stages": 0}), ['pipeline.stages: 0 is not "auto" or an integer >= 1']),
    ("moe-k", cfg(moe={"k": 3}), ["moe.k: 3 is not one of 1, 2"]),
    (
        "flops-profile-step",
        cfg(flops_profiler={"enabled": True, "profile_step": 0}),
        ["flops_profiler.profile_step: 0 is out of range: must be >= 1"],
    ),
    ("aio-block", cfg(aio={"block_size": "big"}), ['aio.block_size: "big" is not an integer']),
    (
        "alias-conflict",
        cfg(zero_optimization={"stage": 3, "prefetch_bucket_size": 10, "stage3_prefetch_bucket_size": 20}),
        [
            "zero_optimization.prefetch_bucket_size and zero_optimization.stage3_prefetch_bucket_size",
            "different values 10, 20",
        ],
    ),
    (
        "cpu-offload-and-new",
        cfg(zero_optimization={"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}),
        ["zero_optimization.cpu_offload and zero_optimization.offload_optimizer are both given"],
    ),
    (
        "unknown-switch-type",
        cfg(zero_allow_unknown_keys="yes"),
        ["zero_allow_unknown_keys: 'yes' is not a boolean"],
    ),
    (
        "batch-inconsistent",
        {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
        ["batch sizes are inconsistent", "train_batch_size=10", "world size=1"],
    ),
    (
        "no-batch",
        {"zero_optimization": {"stage": 1}},
        ["give train_batch_size or train_micro_batch_size_per_gpu"],
    ),
]


@pytest.mark.parametrize("config,expected", [pytest.param(c, e, id=i) for i, c, e in BAD_CONFIGS])
def test_bad_config_message(config, expected, monkeypatch):
    monkeypatch.delenv("ZERO_CONFIG_UNKNOWN_KEYS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ConfigError) as info:
            load_config(config, world_size=1)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in:\n{message}"


def test_table_is_large_enough():
    assert len(BAD_CONFIGS) >= 25
    assert len({i for i, _, _ in BAD_CONFIGS}) == len(BAD_CONFIGS)


def test_config_error_is_value_error_and_lists_problems():
    with pytest.raises(ValueError) as info:
        load_config(
            cfg(gradient_clipp1ng=1.0, zero_optimization={"stage": 7, "stgae": 1}, fp16={"enabled": "x"})
        )
    err = info.value
    assert isinstance(err, ConfigError)
    assert len(err.problems) == 4
    assert "4 problems" in str(err)
    assert any(
        p.startswith("zero_optimization.stgae: unknown key, did you mean stage?") for p in err.problems
    )
    assert any(p.startswith("zero_optimization.stage: 7 is not one of") for p in err.problems)


def test_unknown_keys_downgraded_by_config_switch():
    with pytest.warns(UserWarning, match=r"gradient_clipp1ng: unknown key, did you mean gradient_clipping\?"):
        config = load_config(cfg(gradient_clipp1ng=0.5, zero_allow_unknown_keys=True))
    assert config.gradient_clipping == 1.0  # the misspelt key was ignored, not applied
    assert "gradient_clipp1ng" not in config.to_dict()


def test_unknown_keys_downgraded_by_environment(monkeypatch):
    monkeypatch.setenv("ZERO_CONFIG_UNKNOWN_KEYS", "warn")
    with pytest.warns(UserWarning, match=r"zero_optimization\.stgae: unknown key, did you mean stage\?"):
        config = load_config(cfg(zero_optimization={"stgae": 2}))
    assert config.zero_optimization.stage == 0
    # the switch does not hide real errors
    with pytest.raises(ConfigError, match="5 is not one of"):
        load_config(cfg(zero_optimization={"stage": 5}))


def test_unknown_scheduler_param_downgraded(monkeypatch):
    monkeypatch.setenv("ZERO_CONFIG_UNKNOWN_KEYS", "warn")
    with pytest.warns(UserWarning, match="warmup_max_l: unknown key, did you mean warmup_max_lr"):
        config = load_config(cfg(scheduler={"type": "WarmupLR", "params": {"warmup_max_l": 0.1}}))
    assert config.scheduler.params == {}


def test_bad_environment_switch(monkeypatch):
    monkeypatch.setenv("ZERO_CONFIG_UNKNOWN_KEYS", "sometimes")
    with pytest.raises(ConfigError, match="ZERO_CONFIG_UNKNOWN_KEYS='sometimes' is not one of"):
        load_config(cfg())


def test_unknown_key_without_close_match_lists_known_keys():
    with pytest.raises(ConfigError) as info:
        load_config(cfg(tensorboard={"xyz": 1}))
    assert "tensorboard.xyz: unknown key; known keys are enabled, job_name, output_path" in str(info.value)


def test_unknown_keys_error_says_how_to_load_anyway():
    # LLaMA-Factory's ds_z3_offload_config.json: keys DeepSpeed silently ignores.
    config = cfg(comms_config={"verbose": False}, monitor_config={"enabled": True})
    with pytest.raises(ConfigError) as info:
        load_config(config)
    err = info.value
    assert err.problems == [
        "comms_config: unknown key, did you mean comms_logger?",
        "monitor_config: unknown key",
    ]
    assert '"zero_allow_unknown_keys": true or ZERO_CONFIG_UNKNOWN_KEYS=warn' in str(err)
    assert "DeepSpeed silently ignores keys it does not know" in str(err)
    # the hint is only for unknown keys
    with pytest.raises(ConfigError) as info:
        load_config(cfg(zero_optimization={"stage": 5}))
    assert info.value.hint is None and "zero_allow_unknown_keys" not in str(info.value)
    with pytest.warns(UserWarning, match="unknown key"):
        assert load_config({**config, "zero_allow_unknown_keys": True}).train_batch_size == 8


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage3_is_ignored_with_a_warning(stage):
    # DeepSpeed accepts offload_param at every stage and uses it only at stage 3 (trlx's
    # ds_config_gptj.json and DeepSpeed's tests/hybrid_engine config carry it at stages 2 and 0).
    zero = {"stage": stage, "offload_param": {"device": "cpu"}}
    if stage:
        zero["offload_optimizer"] = {"device": "cpu"}
    with pytest.warns(UserWarning, match=rf"offload_param: .*only at stage 3; ignored at stage {stage}"):
        z = load_config(cfg(zero_optimization=zero)).zero_optimization
    assert z.offload_param is None and z.offload_param_device == "none"
    assert z.offload_optimizer_device == ("cpu" if stage else "none")
    # at stage 3 it is used, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z3 = load_config(
            cfg(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}})
        ).zero_optimization
    assert z3.offload_param_device == "cpu"


def test_contiguous_checkpointing_without_number_checkpoints_loads(monkeypatch):
    # DeepSpeedExamples Megatron-LM/scripts/ds_zerodual_config.json: Megatron passes its layer
    # count to checkpointing.configure(num_checkpoints=...), so the config need not give it.
    section = {
        "partition_activations": True,
        "contiguous_memory_optimization": True,
        "cpu_checkpointing": True,
    }
    with pytest.warns(FutureWarning, match="cpu_offload is deprecated"):
        config = load_config(
            {
                "train_batch_size": 16,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 2, "cpu_offload": True},
                "activation_checkpointing": section,
            },
            world_size=1,
        )
    ac = config.activation_checkpointing
    assert ac.contiguous_memory_optimization and ac.number_checkpoints is None
    from zero_core import activation_checkpointing
    from zero_core.activation_checkpointing import checkpointing

    # configure() sets process-wide state: restore it after the test (later engines in this
    # process would otherwise take it for the caller's own configuration)
    monkeypatch.setattr(
        checkpointing, "_STATE", checkpointing.CheckpointingState(**vars(checkpointing._STATE))
    )
    with pytest.raises(ValueError, match="needs 'number_checkpoints'"):
        activation_checkpointing.configure(deepspeed_config=config)
    activation_checkpointing.configure(deepspeed_config=config, num_checkpoints=24)
    assert activation_checkpointing.get_config().number_checkpoints == 24


def test_underscore_keys_are_comments():
    # LLaMA-Factory's ds_z2_autotp_config.json: "_comment" keys, JSON's stand-in for comments.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_config(
            cfg(_comment="stage 2", zero_optimization={"stage": 2, "_note": "offload later"})
        )
    assert loaded.zero_optimization.stage == 2
    assert "_comment" not in loaded.to_dict() and "_note" not in loaded.to_dict()["zero_optimization"]
    # an unknown key without the underscore is still an error
    with pytest.raises(ConfigError, match="comment: unknown key"):
        load_config(cfg(comment="stage 2"))
