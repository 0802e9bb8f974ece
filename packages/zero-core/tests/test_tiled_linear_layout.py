"""``TiledLinear`` has DeepSpeed's layout: part boundaries in ``in_parts``/``out_parts`` and the
bias on the last input tile, so its state dict has DeepSpeed's keys and shapes."""

from __future__ import annotations

import torch
from zero_core.zero.stage3.tiled_linear import TiledLinear


def test_parts_are_boundaries_and_bias_sits_on_last_input_tile():
    tl = TiledLinear(10, 5, bias=True, in_splits=3, out_splits=2)
    assert tl.in_parts == [0, 4, 7, 10] and tl.out_parts == [0, 3, 5]
    shapes = {k: tuple(v.shape) for k, v in tl.state_dict().items()}
    # keys and shapes as DeepSpeed's TiledLinear(10, 5, in_splits=3, out_splits=2) names them
    want = {}
    for o, (r0, r1) in enumerate([(0, 3), (3, 5)]):
        for i, (c0, c1) in enumerate([(0, 4), (4, 7), (7, 10)]):
            want[f"linears.{o}.{i}.weight"] = (r1 - r0, c1 - c0)
        want[f"linears.{o}.2.bias"] = (r1 - r0,)
    assert shapes == want


def test_equals_the_linear_it_was_copied_from_and_loads_a_deepspeed_layout_state_dict():
    torch.manual_seed(0)
    ref = torch.nn.Linear(10, 5)
    tl = TiledLinear(10, 5, in_splits=3, out_splits=2, init_linear=ref)
    x = torch.randn(4, 10)
    torch.testing.assert_close(tl(x), ref(x), rtol=1e-6, atol=1e-6)
    # a state dict written in DeepSpeed's layout (slices of the full weight, bias on the last tile)
    sd = {}
    for o, (r0, r1) in enumerate(zip(tl.out_parts, tl.out_parts[1:])):
        for i, (c0, c1) in enumerate(zip(tl.in_parts, tl.in_parts[1:])):
            sd[f"linears.{o}.{i}.weight"] = ref.weight[r0:r1, c0:c1].detach().clone() * 2
        sd[f"linears.{o}.2.bias"] = ref.bias[r0:r1].detach().clone() * 2
    fresh = TiledLinear(10, 5, in_splits=3, out_splits=2)
    fresh.load_state_dict(sd)  # strict: same keys
    torch.testing.assert_close(fresh(x), 2 * ref(x), rtol=1e-5, atol=1e-5)


def test_one_split_without_bias():
    tl = TiledLinear(6, 4, bias=False, in_splits=2, out_splits=1)
    assert tl.in_parts == [0, 3, 6] and tl.out_parts == [0, 4]
    assert sorted(tl.state_dict()) == ["linears.0.0.weight", "linears.0.1.weight"]
