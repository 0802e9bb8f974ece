"""The config's ``optimizer`` section builds the right optimizer; zero-ops' optimizers are found
through ``plugins.require`` (their math is tested in zero-ops: ``test_fused_adam_lamb.py``)."""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from zero_core import plugins
from zero_core.optim import build_optimizer


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    "name,params,cls",
    [
        ("Adam", {"lr": 1e-3}, torch.optim.AdamW),  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
        ("adam", {"lr": 1e-3, "adam_w_mode": False}, torch.optim.Adam),
        ("AdamW", {"lr": 1e-3, "betas": [0.8, 0.9], "weight_decay": 0.1}, torch.optim.AdamW),
        ("SGD", {"lr": 0.1, "momentum": 0.9}, torch.optim.SGD),
        ("Adagrad", {"lr": 0.1}, torch.optim.Adagrad),
        ("FusedAdam", {"lr": 1e-3}, torch.optim.AdamW),
        ("RMSprop", {"lr": 1e-3}, torch.optim.RMSprop),  # any torch.optim class name
        ("FusedAdam", {"lr": 1e-3, "bias_correction": True}, torch.optim.AdamW),
    ],
)
def test_builds_each_config_type(name, params, cls):
    opt = build_optimizer(_params(), name, params)
    assert type(opt) is cls
    assert opt.param_groups[0]["lr"] == params["lr"]
    if "betas" in params:
        assert opt.param_groups[0]["betas"] == tuple(params["betas"])


def test_unknown_type_and_bad_params_are_clear_errors():
    with pytest.raises(ValueError, match=r"optimizer.type: 'Adamaxx' is not supported; use one of .*Lamb"):
        build_optimizer(_params(), "Adamaxx", {})
    with pytest.raises(ValueError, match=r"optimizer.type: 'MuAdam' is not provided by this build"):
        build_optimizer(_params(), "MuAdam", {})
    with pytest.raises(ValueError, match=r"optimizer.params for SGD: .*nesterov_typo"):
        build_optimizer(_params(), "SGD", {"lr": 0.1, "nesterov_typo": True})


def _fake_importlib(present: dict[str, types.ModuleType] | None) -> types.SimpleNamespace:
    """An ``importlib`` for ``zero_core.plugins`` that sees zero_ops as absent (None) or as ``present``."""

    def find_spec(name: str):
        if name == "zero_ops":
            return None if present is None else object()
        return importlib.util.find_spec(name)

    def import_module(name: str):
        if present is not None and name in present:
            return present[name]
        return importlib.import_module(name)

    return types.SimpleNamespace(
        util=types.SimpleNamespace(find_spec=find_spec),
        import_module=import_module,
        metadata=importlib.metadata,
    )


def test_cpu_adam_without_zero_ops_names_the_package(monkeypatch):
    monkeypatch.setattr(plugins, "importlib", _fake_importlib(None))
    with pytest.raises(
        plugins.MissingPackageError, match=r"optimizer type CPUAdam needs the 'zero-ops' package"
    ):
        build_optimizer(_params(), "CPUAdam", {"lr": 1e-3})
    with pytest.raises(plugins.MissingPackageError, match=r"pip install packages/zero-ops \(from a clone"):
        build_optimizer(_params(), "DeepSpeedCPUAdam", {"lr": 1e-3})


@pytest.mark.parametrize(
    "name,params,feature",
    [
        ("Lamb", {"lr": 1e-3}, "optimizer type Lamb"),
        ("Adam", {"lr": 1e-3, "bias_correction": False}, 'optimizer "bias_correction": false'),
        ("AdamW", {"lr": 1e-3, "bias_correction": False}, 'optimizer "bias_correction": false'),
        ("OneBitAdam", {"lr": 1e-3}, "optimizer type OneBitAdam"),
        ("zero_one_adam", {"lr": 1e-3}, "optimizer type ZeroOneAdam"),
        ("OnebitLamb", {"lr": 1e-3}, "optimizer type OneBitLamb"),
    ],
)
def test_zero_ops_optimizers_without_zero_ops_name_the_package(monkeypatch, name, params, feature):
    # LAMB, FusedAdam (no bias correction) and the 1-bit family are zero-ops' implementations
    monkeypatch.setattr(plugins, "importlib", _fake_importlib(None))
    with pytest.raises(plugins.MissingPackageError, match=rf"{feature}.* needs the 'zero-ops' package"):
        build_optimizer(_params(), name, params)


def test_cpu_adam_with_zero_ops_builds_its_cpu_adam(monkeypatch):
    class CPUAdam(torch.optim.Adam):
        pass

    fake = types.ModuleType("zero_ops.adam")
    fake.CPUAdam = CPUAdam
    monkeypatch.setattr(plugins, "importlib", _fake_importlib({"zero_ops.adam": fake}))
    opt = build_optimizer(_params(), "CPUAdam", {"lr": 1e-3, "torch_adam": True})
    assert type(opt) is CPUAdam


def test_max_grad_norm_points_to_gradient_clipping():
    with pytest.raises(
        ValueError, match=r'optimizer.params.max_grad_norm \(Adam\).*"gradient_clipping": 1.0'
    ):
        build_optimizer(_params(), "Adam", {"lr": 1e-3, "max_grad_norm": 1.0})
