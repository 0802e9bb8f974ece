"""Batch-size derivation (train = micro * gas * world) and world-size detection."""

from __future__ import annotations

import pytest
from zero_core.config import ConfigError, detect_world_size, load_config, resolve_batch_size

# (train, micro, gas, world) given -> (train, micro, gas) resolved
DERIVATIONS = [
    ((32, 8, 4, 1), (32, 8, 4)),
    ((64, 8, 4, 2), (64, 8, 4)),
    ((64, 8, None, 2), (64, 8, 4)),
    ((64, None, 4, 2), (64, 8, 4)),
    ((None, 8, 4, 2), (64, 8, 4)),
    ((64, None, None, 2), (64, 32, 1)),
    ((64, None, None, 1), (64, 64, 1)),
    ((None, 8, None, 4), (32, 8, 1)),
    ((None, 8, None, 1), (8, 8, 1)),
    ((24, 2, None, 3), (24, 2, 4)),
    ((24, None, 2, 3), (24, 4, 2)),
    (("auto", 2, "auto", 3), (6, 2, 1)),
    ((48.0, 4.0, None, 2), (48, 4, 6)),  # 4.8e1 style floats for int sizes
]


@pytest.mark.parametrize("given,expected", DERIVATIONS)
def test_derivation(given, expected):
    train, micro, gas, world = given
    sizes = resolve_batch_size(train, micro, gas, world_size=world, world_size_source="explicit")
    assert (
        sizes.train_batch_size,
        sizes.train_micro_batch_size_per_gpu,
        sizes.gradient_accumulation_steps,
    ) == expected
    assert sizes.world_size == world and sizes.world_size_source == "explicit"
    assert (
        sizes.train_batch_size
        == sizes.train_micro_batch_size_per_gpu * sizes.gradient_accumulation_steps * world
    )


# (train, micro, gas, world, source) -> substrings of the error
INCONSISTENT = [
    (
        (32, 8, 4, 2, "torchrun env (WORLD_SIZE)"),
        [
            "8 * 4 * 2 = 64 != 32",
            "train_batch_size=32",
            "train_micro_batch_size_per_gpu=8",
            "gradient_accumulation_steps=4",
            "data-parallel world size=2 (from torchrun env (WORLD_SIZE))",
        ],
    ),
    (
        (30, 8, None, 2, "MPI"),
        ["30 is not divisible by 8 * 2", "gradient_accumulation_steps=not given", "(from MPI)"],
    ),
    (
        (30, None, 4, 2, "Slurm"),
        ["30 is not divisible by 4 * 2", "train_micro_batch_size_per_gpu=not given", "(from Slurm)"],
    ),
    ((7, None, None, 2, "explicit"), ["7 is not divisible by the world size 2"]),
]


@pytest.mark.parametrize("given,expected", INCONSISTENT)
def test_inconsistent_triple_message(given, expected):
    train, micro, gas, world, source = given
    with pytest.raises(ConfigError) as info:
        resolve_batch_size(train, micro, gas, world_size=world, world_size_source=source)
    for part in expected:
        assert part in str(info.value), f"{part!r} not in {info.value}"


@pytest.mark.parametrize(
    "args,message",
    [
        ((None, None, None), "give train_batch_size or train_micro_batch_size_per_gpu"),
        ((None, None, 4), "gradient_accumulation_steps=4 alone is not enough"),
        ((0, None, None), "train_batch_size: 0 is out of range: must be >= 1"),
        ((True, None, None), "train_batch_size: True is not an integer"),
        ((8, 2.5, None), "train_micro_batch_size_per_gpu: 2.5 is not an integer"),
    ],
)
def test_bad_sizes(args, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        resolve_batch_size(*args, world_size=1)


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True, "2"])
def test_bad_world_size(world_size):
    with pytest.raises(ConfigError, match="world_size"):
        resolve_batch_size(8, world_size=world_size)


_ENV = ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"]


@pytest.fixture
def clean_env(monkeypatch):
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, (1, "default (single process)")),
        ({"WORLD_SIZE": "4"}, (4, "torchrun env (WORLD_SIZE)")),
        ({"OMPI_COMM_WORLD_SIZE": "3"}, (3, "MPI (OMPI_COMM_WORLD_SIZE)")),
        ({"PMI_SIZE": "5"}, (5, "MPI (PMI_SIZE)")),
        ({"SLURM_NTASKS": "6"}, (6, "Slurm (SLURM_NTASKS)")),
        ({"SLURM_NTASKS": "6", "WORLD_SIZE": "2"}, (2, "torchrun env (WORLD_SIZE)")),
    ],
)
def test_detect_world_size(clean_env, env, expected):
    for var, value in env.items():
        clean_env.setenv(var, value)
    assert detect_world_size() == expected


def test_detect_world_size_bad_env(clean_env):
    clean_env.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not an integer"):
        detect_world_size()


def test_load_config_uses_detected_world_size(clean_env):
    clean_env.setenv("WORLD_SIZE", "2")
    cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8})
    assert cfg.gradient_accumulation_steps == 2
    assert cfg.batch_sizes.world_size_source == "torchrun env (WORLD_SIZE)"
    with pytest.raises(ConfigError, match=r"world size=2 \(from torchrun env \(WORLD_SIZE\)\)"):
        load_config(
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}
        )


def test_load_config_explicit_world_size_wins(clean_env):
    clean_env.setenv("WORLD_SIZE", "2")
    cfg = load_config(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, world_size=4, world_size_source="MPI"
    )
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.batch_sizes.world_size == 4 and cfg.batch_sizes.world_size_source == "MPI"


def test_resolve_batch_false_keeps_sizes():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2}, resolve_batch=False)
    assert cfg.train_batch_size is None and cfg.batch_sizes is None
    resolved = cfg.with_batch_sizes(3)
    assert (resolved.train_batch_size, resolved.gradient_accumulation_steps) == (6, 1)
    assert cfg.train_batch_size is None  # with_batch_sizes returns a copy


def test_auto_batch_sizes_name_the_hf_trainer():
    """An HF-Trainer config whose batch sizes are all "auto" says why nothing can be derived."""
    hf = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    with pytest.raises(ConfigError) as info:
        load_config(hf, world_size=2)
    text = str(info.value)
    assert "give train_batch_size or train_micro_batch_size_per_gpu" in text
    assert 'train_batch_size and train_micro_batch_size_per_gpu are "auto"' in text
    assert "HuggingFace Trainer" in text
    with pytest.raises(ConfigError, match='train_micro_batch_size_per_gpu is "auto"'):
        resolve_batch_size(None, "auto", None, world_size=1)
    # one size given: the "auto" ones are derived as if absent
    cfg = load_config({**hf, "train_micro_batch_size_per_gpu": 3}, world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (6, 1)
