"""zero.Init bounds what code at the end of a root ``__init__`` keeps gathered (see [Note: stage 3
construction]).

transformers' ``post_init`` initialises every module's weights from the root's ``__init__``
through its own ``smart_apply`` (not ``Module.apply``), reading each weight as an attribute: each
read gathers it, and before the bound every one stayed gathered until the root's ``__init__``
returned, i.e. the whole model. Here a model does the same: with ``stage3_max_live_parameters``
of two layers, at most two layers (plus the module being read) are gathered at any time, the
values written are exact on every rank (parameters cut early keep what was written), and a
module read through ``named_parameters()`` keeps all of its own parameters while it is read.
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank

WIDTH, LAYERS = 32, 6
LAYER = WIDTH * WIDTH + WIDTH


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.peak_gathered = 0
        for i, m in enumerate(self.layers):  # as transformers' post_init: module by module, by attribute
            m.weight.data.fill_(float(i + 1))
            m.bias.data.fill_(-float(i + 1))
            self.peak_gathered = max(self.peak_gathered, _gathered_elements(self))
        for _name, p in self.layers[0].named_parameters():  # gathers both of the module's parameters first
            p.data.add_(100.0)


def _gathered_elements(model: torch.nn.Module) -> int:
    from zero_core.zero.stage3.param_records import partition_state
    from zero_core.zero.stage3.partitioned_param import ParamStatus

    total = 0
    for m in model.modules():
        for p in dict.values(m._parameters):
            st = partition_state(p)
            total += st.numel if st.status is ParamStatus.AVAILABLE else 0
    return total


def _build(max_live: int | None) -> dict:
    import zero_core
    from zero_core.zero.stage3 import GatheredParameters

    zc = {"stage": 3} if max_live is None else {"stage": 3, "stage3_max_live_parameters": max_live}
    with zero_core.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zc}):
        model = Net()
    values = {}
    for n, p in model.named_parameters():
        with GatheredParameters([p]):
            values[n] = p.detach().clone()
    return {"peak": model.peak_gathered, "values": values}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_construction_keeps_at_most_max_live_gathered(world: int) -> None:
    for bounded, unbounded in run_multirank(lambda: (_build(2 * LAYER), _build(None)), world):
        assert unbounded["peak"] == LAYERS * LAYER  # before the bound: the whole model
        assert bounded["peak"] <= 3 * LAYER, bounded["peak"]
        for n, v in unbounded["values"].items():
            i = int(n.split(".")[1])
            want = (1.0 if n.endswith("weight") else -1.0) * (i + 1) + (100.0 if i == 0 else 0.0)
            assert torch.equal(v, torch.full_like(v, want)), n
            assert torch.equal(bounded["values"][n], v), n
