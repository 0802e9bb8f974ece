"""Plugin sections: built-in permissive models, replacement by register_config_section and by the
``zero.config_sections`` entry point group."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
import warnings

import pytest
from pydantic import BaseModel, ConfigDict, Field
from zero_core.config import (
    ENTRY_POINT_GROUP,
    ConfigError,
    ZeroConfig,
    config_sections,
    load_config,
    refresh_entry_points,
    register_config_section,
    section_model,
    unregister_config_section,
)
from zero_core.config.builtin_sections import PipelineConfig


@pytest.fixture
def builtin_sections_only(monkeypatch):
    """Pin zero-core's own built-in section models: packages installed alongside (zero-pipe
    registers a strict ``pipeline`` model) must not change what these tests check."""
    from zero_core.config import sections

    monkeypatch.setattr(sections, "_entry_points", {})


class StrictPipeline(BaseModel):
    """What zero-pipe would register: strict, with its own fields and defaults."""

    model_config = ConfigDict(extra="forbid")
    stages: int = Field(1, ge=1)
    partition: str = "parameters"
    schedule: str = "1f1b"


class InferenceSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tp_size: int = 1


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    for name in ("pipeline", "inference_demo"):
        try:
            unregister_config_section(name)
        except KeyError:
            pass
    refresh_entry_points()


@pytest.mark.usefixtures("builtin_sections_only")
def test_builtin_section_is_permissive():
    cfg = load_config(
        {
            "train_batch_size": 1,
            "pipeline": {"stages": 4, "activation_checkpoint_interval": 1, "some_future_key": [1, 2]},
        }
    )
    assert isinstance(cfg.pipeline, PipelineConfig)
    assert cfg.pipeline.stages == 4 and cfg.pipeline.some_future_key == [1, 2]
    assert cfg.to_dict()["pipeline"]["some_future_key"] == [1, 2]


@pytest.mark.usefixtures("builtin_sections_only")
def test_builtin_section_warns_about_likely_typos():
    with pytest.warns(UserWarning, match=r"pipeline\.seed_layer: unknown key, did you mean seed_layers\?"):
        cfg = load_config({"train_batch_size": 1, "pipeline": {"seed_layer": True}})
    assert cfg.pipeline.seed_layers is False  # kept as an extra key, not applied


def test_builtin_section_defaults():
    cfg = load_config({"train_batch_size": 1})
    assert cfg.pipeline.stages == "auto" and cfg.pipeline.partition == "best"
    assert cfg.aio.block_size == 1_048_576 and cfg.aio.queue_depth == 8
    assert cfg.flops_profiler.enabled is False and cfg.flops_profiler.module_depth == -1
    assert cfg.moe.num_experts == 1 and cfg.autotuning.metric == "throughput"


def test_registered_model_replaces_builtin():
    register_config_section("pipeline", StrictPipeline)
    assert section_model("pipeline") is StrictPipeline
    cfg = load_config({"train_batch_size": 1, "pipeline": {"stages": 2, "schedule": "gpipe"}})
    assert isinstance(cfg.pipeline, StrictPipeline)
    assert (cfg.pipeline.stages, cfg.pipeline.partition, cfg.pipeline.schedule) == (2, "parameters", "gpipe")
    assert isinstance(load_config({"train_batch_size": 1}).pipeline, StrictPipeline)  # defaults too
    # the registered model is strict: unknown keys get a suggestion, bad values a path
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, "pipeline": {"stages": 0, "schedul": "x"}})
    message = str(info.value)
    assert "pipeline.schedul: unknown key, did you mean schedule?" in message
    assert "pipeline.stages: 0 is out of range: must be >= 1" in message
    cfg = load_config({"train_batch_size": 1, "pipeline": {"stages": 3}})
    assert load_config(cfg.to_dict()) == cfg


@pytest.mark.usefixtures("builtin_sections_only")
def test_unregister_restores_builtin():
    register_config_section("pipeline", StrictPipeline)
    unregister_config_section("pipeline")
    assert section_model("pipeline") is PipelineConfig
    with pytest.raises(KeyError):
        unregister_config_section("pipeline")


def test_new_section_name():
    register_config_section("inference_demo", InferenceSection)
    cfg = load_config({"train_batch_size": 1, "inference_demo": {"tp_size": 2}})
    assert cfg.section("inference_demo").tp_size == 2
    assert cfg.to_dict()["inference_demo"] == {"tp_size": 2}
    assert load_config(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="inference_demo.tp_size"):
        load_config({"train_batch_size": 1, "inference_demo": {"tp_size": "x"}})
    unregister_config_section("inference_demo")
    with pytest.raises(ConfigError, match="inference_demo: unknown key"):
        load_config({"train_batch_size": 1, "inference_demo": {"tp_size": 2}})


@pytest.mark.parametrize(
    "name,model,error",
    [
        ("zero_optimization", StrictPipeline, "core config key"),
        ("fp16", StrictPipeline, "core config key"),
        ("bfloat16", StrictPipeline, "core config key"),
        ("not an identifier", StrictPipeline, "must be an identifier"),
        (3, StrictPipeline, "must be an identifier"),
        ("pipeline", dict, "must be a pydantic BaseModel subclass"),
        ("pipeline", StrictPipeline(), "must be a pydantic BaseModel subclass"),
    ],
)
def test_register_validates_input(name, model, error):
    with pytest.raises((ValueError, TypeError), match=error):
        register_config_section(name, model)


def _write_plugin(tmp_path, monkeypatch, body: str, value: str, name: str = "pipeline"):
    module = value.partition(":")[0]
    monkeypatch.delitem(sys.modules, module, raising=False)
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = importlib.metadata.EntryPoints(
        [importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)]
    )
    real = importlib.metadata.entry_points

    def fake(**kwargs):
        return eps if kwargs.get("group") == ENTRY_POINT_GROUP else real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    refresh_entry_points()


def test_entry_point_discovery(tmp_path, monkeypatch):
    _write_plugin(
        tmp_path,
        monkeypatch,
        """
        from pydantic import BaseModel, ConfigDict
        class PipeSection(BaseModel):
            model_config = ConfigDict(extra="forbid")
            stages: int = 1
            micro_batches: int = 8
        """,
        "zero_demo_plugin:PipeSection",
    )
    model = config_sections()["pipeline"]
    assert model.__name__ == "PipeSection"
    cfg = load_config({"train_batch_size": 1, "pipeline": {"stages": 2}})
    assert (cfg.pipeline.stages, cfg.pipeline.micro_batches) == (2, 8)
    # an explicit registration wins over the entry point
    register_config_section("pipeline", StrictPipeline)
    assert isinstance(load_config({"train_batch_size": 1}).pipeline, StrictPipeline)


def test_broken_entry_point_is_reported(tmp_path, monkeypatch):
    _write_plugin(tmp_path, monkeypatch, "raise RuntimeError('boom')\n", "zero_broken_plugin:Missing")
    with pytest.raises(ImportError, match="config section 'pipeline': loading entry point .* failed: boom"):
        load_config({"train_batch_size": 1})


def test_direct_model_validate_uses_registry():
    register_config_section("pipeline", StrictPipeline)
    cfg = ZeroConfig.model_validate({"pipeline": {"stages": 5}})
    assert isinstance(cfg.pipeline, StrictPipeline) and cfg.pipeline.stages == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ZeroConfig().pipeline == StrictPipeline()
