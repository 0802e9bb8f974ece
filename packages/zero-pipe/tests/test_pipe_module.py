"""PipelineModule partitioning and local building (single process, explicit stage_id)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_pipe import LayerSpec, PipelineModule, ProcessTopology, RepeatingLoader, TiedLayerSpec
from zero_pipe.partition import partition_balanced, partition_uniform


class Counting(nn.Linear):
    built = 0

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        if self.weight.device.type != "meta":
            Counting.built += 1


def test_partition_helpers():
    assert partition_uniform(5, 2) == [0, 3, 5]
    assert partition_balanced([1, 1, 10, 1], 2) == [0, 2, 4] or partition_balanced([1, 1, 10, 1], 2) == [
        0,
        3,
        4,
    ]
    assert partition_balanced([4, 1, 1, 1, 1], 2) == [0, 1, 5]
    with pytest.raises(ValueError, match="non-empty"):
        partition_uniform(1, 2)


def test_builds_only_local_layers_and_balances_parameters():
    Counting.built = 0
    specs = [
        LayerSpec(Counting, 64, 64),
        LayerSpec(nn.ReLU),
        LayerSpec(Counting, 4, 4),
        LayerSpec(Counting, 4, 4),
    ]
    stage1 = PipelineModule(specs, num_stages=2, stage_id=1)
    assert stage1.parts == [0, 1, 4]
    assert list(stage1.local_layer_range()) == [1, 2, 3]
    assert Counting.built == 2  # the big layer of stage 0 was only built on the meta device
    out = stage1(torch.randn(3, 64).relu()[:, :4])
    assert out.shape == (3, 4)


def test_type_and_uniform_partitions():
    specs = [LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.ReLU)]
    assert PipelineModule(specs, num_stages=2, stage_id=0, partition_method="type:linear").parts in (
        [0, 1, 4],
        [0, 2, 4],
    )
    assert PipelineModule(specs, num_stages=4, stage_id=0, partition_method="uniform").parts == [
        0,
        1,
        2,
        3,
        4,
    ]
    with pytest.raises(ValueError, match="matches no layer"):
        PipelineModule(specs, num_stages=2, stage_id=0, partition_method="type:conv")
    with pytest.raises(ValueError, match="partition_method"):
        PipelineModule(specs, num_stages=2, stage_id=0, partition_method="bogus")


def test_activation_checkpointing_same_gradients():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)]
    plain = PipelineModule(layers, num_stages=1, stage_id=0)
    ckpt = PipelineModule(layers, num_stages=1, stage_id=0, activation_checkpoint_interval=1)
    x = torch.randn(2, 4)
    plain(x).sum().backward()
    g1 = [p.grad.clone() for p in plain.parameters()]
    for p in plain.parameters():
        p.grad = None
    ckpt(x).sum().backward()
    for a, p in zip(g1, ckpt.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_validation_and_repeating_loader():
    with pytest.raises(ValueError, match="num_stages or topology"):
        PipelineModule([nn.ReLU()])
    with pytest.raises(ValueError, match="cannot fill"):
        PipelineModule([nn.ReLU()], num_stages=2, stage_id=0)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="num_stages must be an int >= 1"):
            PipelineModule([nn.ReLU()], num_stages=bad, stage_id=0)
    with pytest.raises(TypeError, match="layers must be a list"):
        PipelineModule(nn.Linear(2, 2), num_stages=1, stage_id=0)
    assert PipelineModule(nn.ModuleList([nn.ReLU()]), num_stages=1, stage_id=0).parts == [0, 1]
    with pytest.raises(ValueError, match="'pipe' axis"):
        PipelineModule([nn.ReLU()], topology=ProcessTopology(["data"], [1]), stage_id=0)
    loader = RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]


class _Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(7, 4)


def test_tied_weight_attr_dotted_path_and_errors():
    # DeepSpeed resolves tied_weight_attr as a dotted path ("wte.weight" inside an embedding wrapper).
    spec = TiedLayerSpec("embed", _Embedding, tied_weight_attr="wte.weight")
    model = PipelineModule([spec, LayerSpec(nn.ReLU)], num_stages=1, stage_id=0)
    assert model.tied_weight("embed", "wte.weight") is model.tied_modules["embed"].wte.weight
    with pytest.raises(AttributeError, match=r"'wte\.wieght' does not resolve on _Embedding .*'wieght'"):
        PipelineModule(
            [TiedLayerSpec("embed", _Embedding, tied_weight_attr="wte.wieght")], num_stages=1, stage_id=0
        )
    with pytest.raises(TypeError, match="'wte' resolves to Embedding, not a tensor"):
        PipelineModule([TiedLayerSpec("embed", _Embedding, tied_weight_attr="wte")], num_stages=1, stage_id=0)
