"""DeepSpeed sections zero does not implement: present-but-off loads, switched-on is a clear error.

Single keys (and the keys without effect) are checked over every field by test_config_truth.py.
"""

from __future__ import annotations

import warnings

import pytest
from zero_core.config.errors import ConfigError
from zero_core.config.loader import load_config
from zero_core.config.unimplemented import NEWER_KEYS, UNIMPLEMENTED

BASE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}

ON = {
    "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"},
    "data_efficiency": {"enabled": True},
    "compression_training": {"enabled": True},
    "eigenvalue": {"enabled": True},
    "hybrid_engine": {"enabled": True},
    "elasticity": {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [8]},
    "nebula": {"enabled": True},
    "compile": {"deepcompile": True},
    "sparse_attention": {"enabled": True},
    "amp": {"enabled": True, "opt_level": "O1"},
    "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
    "comet": {"enabled": True},
    "weight_quantization": {"post_init_quant": {}},
    "quantize_training": {"enabled": True},
    "tensor_parallel": {"autotp_size": 2},
    "use_data_before_expert_parallelism": True,
}
OFF = {
    "progressive_layer_drop": {"enabled": False},
    "hybrid_engine": {"enabled": False},
    "compile": {"deepcompile": False},
    "torch_autocast": {"enabled": False},
    "comet": {"enabled": False},
    "tensor_parallel": {"autotp_size": 1},
    "use_data_before_expert_parallelism": False,
    "autotuning": {"enabled": False},
}


def test_every_fatal_feature_has_a_switched_on_case() -> None:
    assert {k for k, e in UNIMPLEMENTED.items() if e.is_on is not None} == set(ON)


@pytest.mark.parametrize("name", sorted(ON))
def test_switched_on_is_an_error_naming_the_section(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, name: ON[name]}, world_size=1)
    text = str(info.value)
    assert f"{name}:" in text and "zero does not implement" in text and UNIMPLEMENTED[name].instead in text


@pytest.mark.parametrize("name", sorted(OFF))
def test_present_but_off_loads_silently(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({**BASE, name: OFF[name]}, world_size=1)
    assert cfg.train_batch_size == 8
    if name in NEWER_KEYS:
        assert name not in cfg.to_dict()


def test_autotuning_is_implemented_and_loads_silently() -> None:
    # zero run --autotuning reads the section (see zero_profiler.autotuning); loading it is not a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({**BASE, "autotuning": {"enabled": True, "metric_path": "m.json"}}, world_size=1)
    assert cfg.autotuning.enabled and cfg.autotuning.metric_path == "m.json"


def test_the_unknown_keys_switch_downgrades_to_a_warning() -> None:
    with pytest.warns(UserWarning, match="curriculum_learning: .* \\(ignored\\)"):
        load_config(
            {**BASE, "zero_allow_unknown_keys": True, "curriculum_learning": {"enabled": True}},
            world_size=1,
        )


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "comet": {"enabled": True}, "gradient_clipp1ng": 1.0}, world_size=1)
    text = str(info.value)
    assert "comet:" in text and "did you mean gradient_clipping" in text


def test_compression_switched_on_per_technique_as_deepspeed_writes_it():
    # DeepSpeed's compression section has no top-level "enabled": each technique has its own.
    on = {
        "weight_quantization": {"shared_parameters": {"enabled": False}},
        "sparse_pruning": {"shared_parameters": {"enabled": True, "method": "l1"}, "different_groups": {}},
    }
    with pytest.raises(ConfigError, match="compression_training"):
        load_config({**BASE, "compression_training": on})
    with pytest.raises(ConfigError, match="compression_training"):
        load_config(
            {**BASE, "compression_training": {"layer_reduction": {"enabled": True, "keep_number_layer": 2}}}
        )
    off = {
        "weight_quantization": {"shared_parameters": {"enabled": False}},
        "layer_reduction": {"enabled": False},
    }
    load_config({**BASE, "compression_training": off})


def test_a_long_section_is_cut_in_the_message():
    # a real compression section runs to ~1,000 characters: the message quotes its start only
    layers = {
        f"group_{i}": {"params": {"target_bits": 8}, "modules": [f"layer.{i}.attention"]} for i in range(20)
    }
    section = {"weight_quantization": {"shared_parameters": {"enabled": True}, "different_groups": layers}}
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, "compression_training": section})
    (problem,) = info.value.problems
    quoted = problem.split(": ", 1)[1].split(" switches on ")[0]
    assert quoted.endswith("...") and len(quoted) == 120
    assert problem.startswith(
        'compression_training: {"weight_quantization": {"shared_parameters": {"enabled": true}'
    )


def test_compile_switched_on_by_its_enabled_key_too():
    with pytest.raises(ConfigError, match="compile: .* switches on torch.compile"):
        load_config({**BASE, "compile": {"enabled": True}}, world_size=1)
    load_config({**BASE, "compile": {"enabled": False, "backend": "eager"}}, world_size=1)
