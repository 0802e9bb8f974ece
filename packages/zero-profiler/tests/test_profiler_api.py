"""The FlopsProfiler / get_model_profile API: lifecycle, printing, validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zero_profiler import FlopsProfiler, get_model_profile


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_lifecycle_reset_and_strings():
    model = mlp()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(2, 8))
    flops = prof.get_total_flops()
    assert flops == 2 * 2 * 8 * 16 + 2 * 16 + 2 * 2 * 16 * 4
    assert prof.get_total_macs() == 2 * 8 * 16 + 2 * 16 * 4
    assert prof.get_total_params() == 8 * 16 + 16 + 16 * 4 + 4
    assert prof.get_total_duration() > 0
    assert prof.get_total_flops(as_string=True) == "800 "
    assert prof.get_total_macs(as_string=True) == "384 MACs"
    model(torch.randn(2, 8))
    assert prof.get_total_flops() == 2 * flops  # two forwards accumulate
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    prof.stop_profile()
    model(torch.randn(2, 8))
    assert prof.get_total_flops() == 0  # nothing counted after stop
    prof.end_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_total_flops()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())  # wrappers removed


def test_print_model_profile_layout(capsys, tmp_path):
    model = mlp()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(2, 8))
    prof.stop_profile()
    prof.print_model_profile(profile_step=3, module_depth=-1, top_modules=2)
    out = capsys.readouterr().out
    assert "Profile Summary at step 3:" in out
    assert "Aggregated Profile per GPU" in out and "Detailed Profile per GPU" in out
    assert "depth 1:" in out and "'Linear'" in out
    assert "(0): Linear(" in out and "in_features=8" in out
    prof.print_model_profile(detailed=False, module_depth=0)
    out = capsys.readouterr().out
    assert "Detailed Profile" not in out and "depth 1:" not in out
    target = tmp_path / "sub" / "profile.txt"
    prof.print_model_profile(output_file=str(target))
    assert "Profile Summary" in target.read_text() and capsys.readouterr().out == ""
    prof.print_model_aggregated_profile(module_depth=1, top_modules=1)
    assert "depth 1:" in capsys.readouterr().out
    prof.end_profile()


def test_printing_keeps_the_totals_as_deepspeeds_attributes(capsys):
    # DeepSpeed's print_model_profile leaves flops / macs / params on the profiler (what
    # engine.flops_profiler.flops reads after the profiled step); they survive end_profile.
    model = mlp()
    prof = FlopsProfiler(model)
    assert (prof.flops, prof.macs, prof.params) == (None, None, None)
    prof.start_profile()
    model(torch.randn(2, 8))
    prof.stop_profile()
    prof.print_model_profile(detailed=False)
    totals = (prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params())
    prof.end_profile()
    assert (prof.flops, prof.macs, prof.params) == totals == (800, 384, 8 * 16 + 16 + 16 * 4 + 4)
    capsys.readouterr()


def test_get_model_profile_input_shape_and_strings(capsys):
    flops, macs, params = get_model_profile(mlp(), input_shape=(64, 8), print_profile=True, top_modules=1)
    assert flops == "25.6 K" and macs == "12.29 KMACs" and params == "212"
    assert "Zero Flops Profiler" in capsys.readouterr().out


def test_train_mode_restores_gradients():
    model = mlp()
    get_model_profile(model, input_shape=(2, 8), print_profile=False, mode="train")
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"mode": "backward"}, "mode must be one of"),
        ({"input_shape": (2, 0)}, "input_shape"),
        ({"input_shape": (2, 8), "args": [torch.randn(2, 8)]}, "either input_shape or args"),
        ({}, "give input_shape"),
        ({"input_shape": (2, 8), "warm_up": -1}, "warm_up"),
        ({"input_shape": (2, 8), "module_depth": -2}, "module_depth"),
        ({"input_shape": (2, 8), "top_modules": 0}, "top_modules"),
        ({"input_shape": (2, 8), "ignore_modules": [int]}, "Module subclasses"),
    ],
)
def test_get_model_profile_validates(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        get_model_profile(mlp(), print_profile=False, **kwargs)


def test_profiler_validates():
    with pytest.raises(TypeError, match="nn.Module"):
        FlopsProfiler("model")
    with pytest.raises(ValueError, match="recompute_fwd_factor"):
        FlopsProfiler(mlp(), recompute_fwd_factor=2.0)
    prof = FlopsProfiler(mlp())
    prof.start_profile()
    with pytest.raises(RuntimeError, match="already started"):
        prof.start_profile()
    prof.end_profile()


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_compiled_module_is_counted():
    from zero_profiler.function_mode import FunctionCountingMode
    from zero_profiler.tracking import _DynamoSafeCountingMode

    expected = 2 * 2 * 8 * 16 + 2 * 16 + 2 * 2 * 16 * 4
    x = torch.randn(2, 8)
    # first compiled while profiling (nothing compiled yet in this process, or something was)
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    prof = FlopsProfiler(model)
    prof.start_profile()
    compiled(x)
    compiled(x)
    prof.stop_profile()
    assert prof.get_total_flops() == 2 * expected
    prof.end_profile()
    # compiled before profiling: Dynamo skips the profiler's frames, recompiles under its mode
    for fast_path in (True, False):
        prof = FlopsProfiler(model, fast_path=fast_path)
        prof.start_profile()
        mode = prof._tracker._mode
        aten_mode = mode._aten_mode if fast_path else mode
        assert isinstance(mode, FunctionCountingMode) == fast_path
        assert isinstance(aten_mode, _DynamoSafeCountingMode)
        compiled(x)
        compiled(x)
        prof.stop_profile()
        assert prof.get_total_flops() == 2 * expected
        prof.end_profile()
