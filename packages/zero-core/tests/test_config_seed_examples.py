"""Every example config of DeepSpeed's config documentation parses, with the values it states.

The examples are transcribed verbatim from DeepSpeed's documents (the ZeRO config reference,
the getting-started guide, and the memory-usage chapter of the API reference). The documentation examples are not strict JSON
(``...`` for "the rest of your config", trailing commas, a missing comma, Python ``False``), so
:func:`doc_json` undoes exactly those liberties before loading; the configs themselves are
unchanged. The ``...`` stands for the rest of a config (batch size included), so the fragments are
loaded with ``resolve_batch=False``. The inference example of the API reference is an ``init_inference`` config,
not a training config, and is validated by zero-inference.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
from zero_core.config import load_config

ZERO3_BASIC = """{
    "zero_optimization": {
        "stage": 3,
    },
    "fp16": {
        "enabled": true
    },
    "optimizer": {
        "type": "AdamW",
        "params": {
        "lr": 0.001,
        "betas": [
            0.8,
            0.999
        ],
        "eps": 1e-8,
        "weight_decay": 3e-7
        }
    },
    ...
}"""

ZERO3_OFFLOAD_OPTIMIZER = """{
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu"
        }
    },
    ...
}"""

ZERO3_OFFLOAD_BOTH_CPU = """{
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu"
        }
        "offload_param": {
            "device": "cpu"
        }
    },
    ...
}"""

ZERO3_OFFLOAD_NVME = """{
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/nvme_data"
        }
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/nvme_data"
        }
    },
    ...
}"""

MICS = """{
    "zero_optimization": {
        "stage": 3,
        "mics_shard_size": 8,
        "mics_hierarchical_params_gather": False,
    },
    ...
}"""

QUICK_START = """{
"train_batch_size": 32,
"train_micro_batch_size_per_gpu": 8,
"zero_optimization": {
"stage": 2,
"offload_optimizer": {
"device": "cpu",
"nvme_path": "/local_nvme/deepspeed"
}
},
"fp16": {
"enabled": true
},
"gradient_accumulation_steps": 4
}"""

# The same config as the Python dict passed as ``config_params`` in DeepSpeed's getting-started guide.
QUICK_START_PARAMS = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 8,
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme/deepspeed"},
    },
    "fp16": {"enabled": True},
    "gradient_accumulation_steps": 4,
}

# DeepSpeed's API reference, memory usage: the offload cases of the ZeRO-2 and ZeRO-3 estimates, and pinned memory.
MEMORY_CASES = [
    (2, '"offload_optimizer": {"device": "cpu"}'),
    (2, '"offload_optimizer": {"device": "none"}'),
    (3, '"offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}'),
    (3, '"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}'),
    (3, '"offload_param": {"device": "none"}, "offload_optimizer": {"device": "cpu"}'),
]
PINNED_CASES = [
    '"cpu_offload_use_pin_memory" : true, "cpu_offload_params": true',
    '"cpu_offload_use_pin_memory" : true, "cpu_offload_params": false',
]


def doc_json(text: str) -> dict:
    """Parse a documentation example: drop ``...`` lines, add the missing comma between two
    members, drop trailing commas, and read Python's ``True``/``False`` as JSON booleans."""
    text = "\n".join(line for line in text.splitlines() if line.strip().rstrip(",") != "...")
    text = re.sub(r"}(\s*\n\s*\")", r"},\1", text)
    text = re.sub(r",(\s*[}\]])", r"\1", text)
    text = re.sub(r"\bFalse\b", "false", re.sub(r"\bTrue\b", "true", text))
    return json.loads(text)


def test_zero3_basic_with_optimizer():
    cfg = load_config(doc_json(ZERO3_BASIC), resolve_batch=False)
    assert cfg.zero_optimization.stage == 3
    assert cfg.fp16.enabled and cfg.precision == "fp16"
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params == {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}
    assert cfg.zero_optimization.overlap_comm is True  # stage 3 default


@pytest.mark.parametrize(
    "text,opt_device,param_device,nvme",
    [
        (ZERO3_OFFLOAD_OPTIMIZER, "cpu", "none", None),
        (ZERO3_OFFLOAD_BOTH_CPU, "cpu", "cpu", None),
        (ZERO3_OFFLOAD_NVME, "nvme", "nvme", "/nvme_data"),
    ],
    ids=["offload-optimizer", "offload-both-cpu", "offload-nvme"],
)
def test_zero3_offload_examples(text, opt_device, param_device, nvme):
    cfg = load_config(doc_json(text), resolve_batch=False)
    zero = cfg.zero_optimization
    assert zero.stage == 3
    assert zero.offload_optimizer_device == opt_device
    assert zero.offload_param_device == param_device
    if nvme:
        assert str(zero.offload_optimizer.nvme_path) == nvme and str(zero.offload_param.nvme_path) == nvme


def test_mics_example():
    cfg = load_config(doc_json(MICS), resolve_batch=False)
    assert cfg.zero_optimization.mics_shard_size == 8
    assert cfg.zero_optimization.mics_hierarchical_params_gather is False


@pytest.mark.parametrize("source", ["json", "params"])
def test_quick_start(source):
    config = doc_json(QUICK_START) if source == "json" else QUICK_START_PARAMS
    cfg = load_config(config, world_size=1)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        32,
        8,
        4,
    )
    assert cfg.zero_optimization.stage == 2
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.fp16.enabled


def test_quick_start_needs_world_size_one():
    # 32 = 8 * 4 * world: on 2 ranks the quick-start triple is inconsistent.
    with pytest.raises(ValueError, match=r"8 \* 4 \* 2 = 64 != 32"):
        load_config(QUICK_START_PARAMS, world_size=2, world_size_source="torchrun env (WORLD_SIZE)")


@pytest.mark.parametrize("stage,fragment", MEMORY_CASES)
def test_memory_usage_fragments(stage, fragment):
    config = doc_json("{" + f'"zero_optimization": {{"stage": {stage}, {fragment}}}' + "}")
    cfg = load_config(config, resolve_batch=False)
    assert cfg.zero_optimization.offload_optimizer is not None


@pytest.mark.parametrize("fragment", PINNED_CASES)
def test_pinned_memory_fragments(fragment):
    config = doc_json("{" + f'"zero_optimization": {{"stage": 3, {fragment}}}' + "}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, resolve_batch=False)
    assert any(issubclass(w.category, FutureWarning) for w in caught)
    offload = cfg.zero_optimization.offload_param
    if '"cpu_offload_params": true' in fragment:
        assert offload.device == "cpu" and offload.pin_memory is True
    else:
        assert offload is None


def test_every_zero_reference_key_has_its_documented_default():
    """The defaults of the ZeRO config reference (DeepSpeed's ZeRO config docs) are ours."""
    zero = load_config({"train_batch_size": 1}).zero_optimization
    expected = {
        "stage": 0,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 500_000_000,
        "use_multi_rank_bucket_allreduce": True,
        "allgather_partitions": True,
        "allgather_bucket_size": 500_000_000,
        "overlap_comm": False,
        "load_from_fp32_weights": True,
        "elastic_checkpoint": False,
        "offload_param": None,
        "offload_optimizer": None,
        "sub_group_size": 1_000_000_000,
        "prefetch_bucket_size": 50_000_000,
        "param_persistence_threshold": 100_000,
        "max_live_parameters": 1_000_000_000,
        "max_reuse_distance": 1_000_000_000,
        "gather_16bit_weights_on_model_save": False,
        "ignore_unused_parameters": True,
        "legacy_stage1": False,
        "round_robin_gradients": False,
        "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False,
        "zero_quantized_gradients": False,
        "mics_shard_size": -1,
        "mics_hierarchical_params_gather": False,
        "memory_efficient_linear": True,
        "pipeline_loading_checkpoint": False,
        "override_module_apply": True,
    }
    for key, value in expected.items():
        assert getattr(zero, key) == value, key
    param = load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "offload_param": {}}})
    p = param.zero_optimization.offload_param
    assert (p.device, p.nvme_path, p.buffer_count, p.buffer_size, p.max_in_cpu, p.pin_memory) == (
        "none",
        None,
        5,
        100_000_000,
        1_000_000_000,
        False,
    )
    o = load_config({"train_batch_size": 1, "zero_optimization": {"stage": 1, "offload_optimizer": {}}})
    o = o.zero_optimization.offload_optimizer
    assert (
        o.device,
        o.buffer_count,
        o.pin_memory,
        o.pipeline_read,
        o.pipeline_write,
        o.fast_init,
        o.ratio,
    ) == ("none", 4, False, False, False, False, 1.0)


def test_monitor_defaults_match_reference():
    cfg = load_config({"train_batch_size": 1})
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path, cfg.tensorboard.job_name) == (
        False,
        "",
        "DeepSpeedJobName",
    )
    assert (cfg.wandb.enabled, cfg.wandb.group, cfg.wandb.team, cfg.wandb.project) == (
        False,
        None,
        None,
        "deepspeed",
    )
    assert (cfg.csv_monitor.enabled, cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == (
        False,
        "",
        "DeepSpeedJobName",
    )


def test_hf_trainer_style_config_with_auto():
    """A config as the HuggingFace Trainer docs write it, "auto" everywhere."""
    config = {
        "fp16": {
            "enabled": "auto",
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }
    with pytest.raises(ValueError, match="give train_batch_size or train_micro_batch_size_per_gpu") as info:
        load_config(config)  # nothing to derive the batch from: HF fills these in
    assert "HuggingFace Trainer" in str(info.value)
    config["train_micro_batch_size_per_gpu"] = 4
    with pytest.warns(UserWarning) as caught:  # the "auto" params that fall back to defaults are named
        cfg = load_config(config, world_size=2)
    said = " ".join(str(w.message) for w in caught)
    assert 'optimizer.params: lr, betas, eps, weight_decay are "auto"' in said
    assert 'scheduler.params: warmup_min_lr, warmup_max_lr, warmup_num_steps are "auto"' in said
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False
    assert cfg.optimizer.params == {}
    assert cfg.scheduler.resolved_params() == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    }
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == 500_000_000 and zero.prefetch_bucket_size == 50_000_000
    assert zero.max_live_parameters == 1_000_000_000 and isinstance(zero.max_live_parameters, int)
    assert zero.gather_16bit_weights_on_model_save is True
    assert cfg.gradient_clipping == 1.0
