"""zero-core's seam to the autotuner, which is zero-profiler's (``zero_profiler.autotuning``).

A DeepSpeed config with an ``autotuning`` section loads and trains with zero-core alone (the
section asks for nothing without ``metric_path``: a warning says the search is run by ``zero run
--autotuning``); what needs the autotuner (an experiment's ``metric_path``, ``zero run
--autotuning``) names zero-profiler's ``autotuning`` extra when zero-profiler is missing. The
hook itself, with zero-profiler present, is tested in zero-profiler's ``test_autotuning.py``.
"""

from __future__ import annotations

import importlib
import os
import types

import pytest
import torch
from zero_core import plugins
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch

HINT = r"'zero-profiler' package, which is not installed: pip install 'packages/zero-profiler\[autotuning\]'"


def _without_zero_profiler() -> types.SimpleNamespace:
    """An ``importlib`` for ``zero_core.plugins`` in which zero_profiler is not installed."""

    def find_spec(name: str):
        return None if name.split(".")[0] == "zero_profiler" else importlib.util.find_spec(name)

    return types.SimpleNamespace(
        util=types.SimpleNamespace(find_spec=find_spec),
        import_module=importlib.import_module,
        metadata=importlib.metadata,
    )


def _train_with_autotuning_section() -> list[float]:
    import warnings

    import zero_core
    from zero_core.engine.autotuning_experiment import EXPERIMENT_ENV

    plugins.importlib = _without_zero_profiler()  # a forked rank: nothing to restore
    os.environ.pop(EXPERIMENT_ENV, None)  # as in a user's own launch
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "autotuning": {"enabled": True, "fast": False, "metric": "latency", "tuner_type": "random"},
    }
    torch.manual_seed(0)
    model = TinyLM(16, 8, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    assert any("the search is run by `zero run --autotuning" in str(w.message) for w in caught), caught
    assert engine._step_hooks == []
    losses = []
    x, y = token_batch(0, 2, 5, 16)  # one batch three times: the loss must fall
    for _ in range(3):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    with pytest.raises(plugins.MissingPackageError, match=rf"autotuning.metric_path .*{HINT}"):
        zero_core.initialize(
            model=TinyLM(16, 8, 12), config={**cfg, "autotuning": {"enabled": True, "metric_path": "m.json"}}
        )
    return losses


def test_a_deepspeed_autotuning_section_trains_without_zero_profiler() -> None:
    (losses,) = run_multirank(_train_with_autotuning_section, 1)
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_zero_run_autotuning_without_zero_profiler_names_the_extra(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from zero_core.launcher.cli import main

    monkeypatch.setattr(plugins, "importlib", _without_zero_profiler())
    (tmp_path / "job.py").write_text("print('not run')\n")
    (tmp_path / "cfg.json").write_text('{"autotuning": {"enabled": true}}')
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--autotuning", "tune", "job.py", "--zero_config", "cfg.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: zero run --autotuning needs the 'zero-profiler' package"), err
    assert "pip install 'packages/zero-profiler[autotuning]' (from a clone" in err, err
