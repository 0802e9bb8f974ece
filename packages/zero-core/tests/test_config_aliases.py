"""DeepSpeed's key aliases, deprecated keys (with a warning naming the replacement), "auto" and
float spellings of integers."""

from __future__ import annotations

import warnings

import pytest
from zero_core.config import ConfigError, load_config

ALIASES = [
    ("stage3_prefetch_bucket_size", "prefetch_bucket_size", 1234),
    ("stage3_param_persistence_threshold", "param_persistence_threshold", 77),
    ("stage3_model_persistence_threshold", "model_persistence_threshold", 99),
    ("stage3_max_live_parameters", "max_live_parameters", 5),
    ("stage3_max_reuse_distance", "max_reuse_distance", 6),
    ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", True),
    # stage3_use_all_reduce_for_fetch_params: not implemented, so setting it is an error naming the
    # canonical key (test_config_truth.py::test_aliases_count_as_the_key)
]


def load_zero(zero: dict):
    return load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, **zero}}).zero_optimization


@pytest.mark.parametrize("alias,name,value", ALIASES)
def test_alias_and_name_are_the_same_key(alias, name, value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # aliases are current spellings: no warning
        by_alias = load_zero({alias: value})
    assert getattr(by_alias, name) == value
    assert by_alias == load_zero({name: value})
    # both spellings with the same value are fine
    assert getattr(load_zero({alias: value, name: value}), name) == value


def test_to_dict_uses_field_names_and_round_trips():
    cfg = load_config(
        {"train_batch_size": 1, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 5}}
    )
    d = cfg.to_dict()
    assert d["zero_optimization"]["max_live_parameters"] == 5
    assert "stage3_max_live_parameters" not in d["zero_optimization"]
    assert load_config(d) == cfg


@pytest.mark.parametrize(
    "zero,replacement,check",
    [
        (
            {"stage": 2, "cpu_offload": True},
            'offload_optimizer: {"device": "cpu"}',
            lambda z: z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory is False,
        ),
        (
            {"cpu_offload_param": True},
            'offload_param: {"device": "cpu"}',
            lambda z: z.offload_param.device == "cpu",
        ),
        (
            {"cpu_offload_params": True},
            'offload_param: {"device": "cpu"}',
            lambda z: z.offload_param.device == "cpu",
        ),
        (
            {"cpu_offload": True, "cpu_offload_use_pin_memory": True},
            "pin_memory",
            lambda z: z.offload_optimizer.pin_memory is True,
        ),
        (
            {"offload_param": {"device": "cpu"}, "cpu_offload_use_pin_memory": True},
            "offload_param.pin_memory",
            lambda z: z.offload_param.pin_memory is True,
        ),
        (
            {"offload_param": {"device": "cpu", "pin_memory": False}, "cpu_offload_use_pin_memory": True},
            "offload_param.pin_memory",
            lambda z: z.offload_param.pin_memory is False,
        ),
        (
            {"cpu_offload": False},
            'offload_optimizer: {"device": "cpu"}',
            lambda z: z.offload_optimizer is None,
        ),
        (
            {"stage3_gather_fp16_weights_on_model_save": True},
            "gather_16bit_weights_on_model_save",
            lambda z: z.gather_16bit_weights_on_model_save is True,
        ),
    ],
    ids=[
        "cpu_offload",
        "cpu_offload_param",
        "cpu_offload_params",
        "pin-legacy",
        "pin-onto-new",
        "pin-explicit-wins",
        "cpu_offload-false",
        "gather_fp16",
    ],
)
def test_deprecated_keys_warn_and_translate(zero, replacement, check):
    zero = {"stage": 3, **zero}
    with pytest.warns(FutureWarning) as record:
        z = load_config({"train_batch_size": 1, "zero_optimization": zero}).zero_optimization
    messages = " ".join(str(w.message) for w in record)
    assert "is deprecated, use zero_optimization." in messages
    assert replacement in messages
    assert check(z)
    # the translated config contains only current keys
    assert not any(k.startswith("cpu_offload") for k in z.to_dict())


def test_legacy_boolean_zero_optimization():
    with pytest.warns(FutureWarning, match=r'use zero_optimization: \{"stage": 1\}'):
        cfg = load_config({"train_batch_size": 1, "zero_optimization": True})
    assert cfg.zero_optimization.stage == 1


def test_bfloat16_is_bf16():
    cfg = load_config({"train_batch_size": 1, "bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled and cfg.precision == "bf16"


def test_floats_for_integers():
    z = load_zero({"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7, "sub_group_size": 1e9})
    assert z.reduce_bucket_size == 500_000_000 and type(z.reduce_bucket_size) is int
    assert z.prefetch_bucket_size == 50_000_000 and z.sub_group_size == 1_000_000_000


@pytest.mark.parametrize(
    "spelling,canonical",
    [
        ("float16", "fp16"),
        ("BF16", "bf16"),
        ("torch.float32", "fp32"),
        ("bfloat16", "bf16"),
        ("half", "fp16"),
    ],
)
def test_communication_data_type_spellings(spelling, canonical):
    cfg = load_config({"train_batch_size": 1, "communication_data_type": spelling})
    assert cfg.communication_data_type == canonical


def test_case_insensitive_choices():
    cfg = load_config(
        {
            "train_batch_size": 1,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "CPU"}},
            "checkpoint": {"tag_validation": "fail"},
            "optimizer": {"type": "adamw"},
            "scheduler": {"type": "warmuplr"},
        }
    )
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert cfg.checkpoint.tag_validation == "Fail"
    assert cfg.optimizer.type == "AdamW" and cfg.scheduler.type == "WarmupLR"


def test_torch_optimizer_names_are_accepted():
    assert load_config({"train_batch_size": 1, "optimizer": {"type": "rmsprop"}}).optimizer.type == "RMSprop"


@pytest.mark.parametrize(
    "key,value,attr,default",
    [
        ("gradient_clipping", "auto", "gradient_clipping", 1.0),
        ("fp16", {"enabled": "auto"}, "fp16.enabled", False),
        ("bf16", {"enabled": "auto"}, "bf16.enabled", False),
        (
            "zero_optimization",
            {"reduce_bucket_size": "auto"},
            "zero_optimization.reduce_bucket_size",
            500_000_000,
        ),
        (
            "zero_optimization",
            {"stage3_param_persistence_threshold": "auto"},
            "zero_optimization.param_persistence_threshold",
            100_000,
        ),
    ],
)
def test_auto_resolves_to_default(key, value, attr, default):
    cfg = load_config({"train_batch_size": 1, key: value})
    obj = cfg
    for part in attr.split("."):
        obj = getattr(obj, part)
    assert obj == default


def test_auto_is_not_accepted_everywhere():
    with pytest.raises(ValueError, match='zero_optimization.stage: "auto" is not an integer'):
        load_config({"train_batch_size": 1, "zero_optimization": {"stage": "auto"}})


def test_overlap_comm_default_depends_on_stage():
    assert load_zero({}).overlap_comm is True
    assert (
        load_config({"train_batch_size": 1, "zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm
        is False
    )
    assert load_zero({"overlap_comm": False}).overlap_comm is False


def test_bf16_ignores_fp16_loss_scaling_keys_with_a_warning():
    # DeepSpeed's tests/torch_compile/ds_config_z2.json and LLaMA-Factory's ds_z3_alst_config.json
    # copy the fp16 block into bf16; DeepSpeed ignores those keys there.
    bf16 = {
        "enabled": True,
        "auto_cast": False,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
        "initial_scale_power": 15,
    }
    with pytest.warns(UserWarning, match=r"bf16: loss_scale, .* auto_cast apply to fp16 only") as record:
        config = load_config({"train_batch_size": 8, "bf16": bf16})
    assert "initial_scale_power" in str(record[0].message) and "ignored, as DeepSpeed does" in str(
        record[0].message
    )
    assert config.bf16.enabled and config.precision == "bf16"
    assert config.to_dict()["bf16"] == {
        "enabled": True,
        "immediate_grad_update": False,
        "check_grad_overflow": True,
        "bf16_master_weights_and_grads": False,
        "bf16_optimizer_states": False,
    }
    # the old spelling of the section behaves the same; typos are still caught
    with pytest.warns(UserWarning, match="bf16: loss_scale applies to fp16 only"):
        assert load_config(
            {"train_batch_size": 8, "bfloat16": {"enabled": True, "loss_scale": 0}}
        ).bf16.enabled
    with pytest.raises(ConfigError, match="bf16.loss_scal: unknown key, did you mean loss_scale"):
        load_config({"train_batch_size": 8, "bf16": {"enabled": True, "loss_scal": 0}})


def test_bf16_keys_of_deepspeed_0_19():
    bf16 = {"enabled": True, "check_grad_overflow": False, "bf16_master_weights_and_grads": False}
    cfg = load_config({"train_batch_size": 1, "bf16": {**bf16, "bf16_optimizer_states": False}})
    assert cfg.bf16.check_grad_overflow is False
    assert load_config({"train_batch_size": 1, "bf16": {"enabled": True}}).bf16.check_grad_overflow is True
    # one without the other is refused (See [Note: bf16 master weights]); test_bf16_master_mode.py
    # covers both together
    for key, says in (
        ("bf16_master_weights_and_grads", "without bf16.bf16_optimizer_states keeps fp32 optimizer states"),
        ("bf16_optimizer_states", "needs bf16.bf16_master_weights_and_grads: true as well"),
    ):
        with pytest.raises(ConfigError, match=rf"bf16.{key}: true {says}"):
            load_config({"train_batch_size": 1, "bf16": {"enabled": True, key: True}})
