"""Module calls under the fast path: forward wrappers, leaf-module rules, attribution.

Counts are checked against ``fast_path=False`` (every ATen operator through the dispatch mode),
per module, forward and backward. See [Note: module calls by forward wrappers] and
[Note: leaf modules].
"""

from __future__ import annotations

import copy
import inspect
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from profiler_models import Block
from torch.overrides import TorchFunctionMode
from zero_profiler import FlopsProfiler
from zero_profiler.function_mode import FunctionCountingMode


def profile(model, args, fast_path=True, train=False):
    """Per-module forward/backward FLOPs and call counts, plus totals and the per-op table."""
    prof = FlopsProfiler(model, fast_path=fast_path)
    prof.track_backward = train
    prof.start_profile()
    with torch.set_grad_enabled(train):
        out = model(*args)
        if train:
            out.sum().backward()
    prof.stop_profile()
    result = dict(
        modules={
            name: (s.fwd_flops, s.fwd_macs, s.bwd_flops, s.calls)
            for name, m in model.named_modules()
            for s in [prof.module_stats(m)]
        },
        totals=(prof.get_total_flops(), prof.get_total_backward_flops()),
        by_op=prof.get_flops_by_op(),
    )
    prof.end_profile()
    model.zero_grad(set_to_none=True)
    for a in args:  # the next run must not accumulate into these (an add counted outside)
        if isinstance(a, torch.Tensor):
            a.grad = None
    return result


def assert_same_as_aten_level(model, *args, train=False):
    fast = profile(model, args, fast_path=True, train=train)
    slow = profile(model, args, fast_path=False, train=train)
    assert fast == slow
    return fast


@pytest.fixture
def seen_by_mode(monkeypatch):
    """Counter of the functions the function mode receives while the test runs."""
    seen = Counter()
    original = FunctionCountingMode.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        seen[func] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(FunctionCountingMode, "__torch_function__", spy)
    return seen


# --- leaf modules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer, x",
    [
        (nn.Linear(8, 6), torch.randn(3, 5, 8)),
        (nn.Linear(8, 6, bias=False), torch.randn(3, 5, 8)),
        (nn.LayerNorm(8), torch.randn(3, 8)),
        (nn.LayerNorm(8, elementwise_affine=False), torch.randn(3, 8)),
        (nn.LayerNorm(8, bias=False), torch.randn(3, 8)),
        (nn.Embedding(10, 4, max_norm=1.0), torch.tensor([[1, 2], [3, 9]])),
        (nn.Dropout(0.4).eval(), torch.randn(3, 8)),
        (nn.GELU(approximate="tanh"), torch.randn(3, 8)),
        (nn.ReLU(inplace=True), torch.randn(3, 8)),
        (nn.SiLU(), torch.randn(3, 8)),
    ],
)
def test_leaf_rules_count_like_aten_level_without_entering_the_functional(layer, x, seen_by_mode):
    model = nn.Sequential(layer)
    fast = assert_same_as_aten_level(model, x.clone())
    functional = {nn.Linear: F.linear, nn.LayerNorm: F.layer_norm, nn.Embedding: F.embedding,
                  nn.Dropout: F.dropout, nn.GELU: F.gelu, nn.ReLU: F.relu, nn.SiLU: F.silu}[type(layer)]  # fmt: skip
    assert functional not in seen_by_mode  # counted by the leaf rule, not by a round trip
    assert fast["modules"]["0"][3] == 1


def test_leaf_rules_decline_what_they_do_not_mirror(seen_by_mode):
    class Scaled(nn.Linear):  # a subclass with its own forward
        def forward(self, x):
            return super().forward(x) * 2

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(8, 8), nn.utils.parametrizations.weight_norm(nn.Linear(8, 4)))
    train_dropout = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(3, 8)
    counts = assert_same_as_aten_level(model, x)
    assert seen_by_mode[F.linear] >= 2  # neither layer took the leaf path
    assert counts["modules"]["0"][0] == 2 * 3 * 8 * 8 + 3 * 8  # addmm (bias not counted), the * 2
    assert_same_as_aten_level(train_dropout, x, train=True)


def test_patched_functional_is_counted_as_what_runs(monkeypatch):
    def my_linear(x, w, b=None):  # another library's replacement: a product and an add
        return x @ w.t() + b

    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    expected = profile(nn.Sequential(lin), (x,), fast_path=True)
    monkeypatch.setattr(F, "linear", my_linear)
    patched = assert_same_as_aten_level(nn.Sequential(lin), x)
    assert patched["totals"][0] == expected["totals"][0] + 3 * 4  # the separate bias add


def test_a_mode_pushed_after_the_profiler_still_sees_the_layers():
    calls = Counter()

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls[func] += 1
            return func(*args, **(kwargs or {}))

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    x = torch.randn(2, 8)
    prof = FlopsProfiler(model)
    prof.start_profile()
    with Watch():
        model(x)
    flops = prof.get_total_flops()
    prof.end_profile()
    assert calls[F.linear] == 1 and calls[F.layer_norm] == 1
    assert flops == 2 * 2 * 8 * 8 + 5 * 2 * 8


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_module_is_counted_at_aten_level():
    scripted = torch.jit.script(nn.Linear(8, 4))
    model = nn.Sequential(nn.Linear(8, 8), scripted)
    counts = assert_same_as_aten_level(model, torch.randn(3, 8))
    assert counts["modules"]["1"][1] == 3 * 8 * 4


# --- attribution --------------------------------------------------------------------------------


class TiedLM(nn.Module):
    """Tied head (a functional call in the root), a block called twice, an einsum, a norm."""

    def __init__(self, vocab=32, c=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.block = Block(c)
        self.mix = nn.Parameter(torch.randn(c, c))
        self.ln_f = nn.LayerNorm(c)

    def forward(self, ids):
        x = self.wte(ids)
        x = self.block(self.block(x))
        x = torch.einsum("btc,cd->btd", x, self.mix) @ self.mix
        return F.linear(self.ln_f(x), self.wte.weight)


@pytest.mark.parametrize("train", [False, True])
def test_attribution_matches_aten_level_per_module(train):
    torch.manual_seed(0)
    model = TiedLM()
    counts = assert_same_as_aten_level(model, torch.randint(0, 32, (2, 6)), train=train)
    assert counts["modules"]["block"][3] == 2
    assert counts["modules"]["block.qkv"][1] == 2 * 2 * 6 * 16 * 48  # two calls
    if train:
        assert counts["totals"][1] > 2 * counts["totals"][0] * 0.9


def test_checkpointed_blocks_under_the_fast_path():
    class Stack(nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.reentrant = reentrant

        def forward(self, x):
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
            return x

    for reentrant in (False, True):
        torch.manual_seed(0)
        x = torch.randn(2, 5, 16, requires_grad=True)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            assert_same_as_aten_level(Stack(reentrant), x, train=True)


# --- forward wrappers ---------------------------------------------------------------------------


def test_wrappers_are_removed_and_foreign_forwards_kept():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    calls = []

    def own_forward(x):  # an instance forward installed before profiling (accelerate-style)
        calls.append("own")
        return nn.Linear.forward(model[2], x)

    model[2].forward = own_forward
    prof = FlopsProfiler(model)
    prof.start_profile()
    assert inspect.signature(model[0].forward) == inspect.signature(nn.Linear(1, 1).forward)
    model(torch.randn(3, 4))
    assert calls == ["own"] and prof.get_total_flops() == 2 * 3 * 4 * 4 + 3 * 4 + 2 * 3 * 4 * 2
    model[1].forward = lambda x: x * 1.0  # installed on top of ours while profiling
    prof.end_profile()
    assert "forward" not in model[0].__dict__
    assert model[2].__dict__["forward"] is own_forward
    assert model[1](torch.ones(1)).item() == 1.0  # the newer forward is left in place


def test_direct_forward_calls_and_exceptions_keep_the_stack_right():
    class Faulty(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, fail=False):
            y = self.lin.forward(x)  # a direct .forward call is a module call too
            if fail:
                raise ValueError("boom")
            return y

    model = Faulty()
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(2, 4), fail=True)
    assert prof._tracker.fwd_stack == []
    model(torch.randn(2, 4))
    assert prof.module_stats(model.lin).calls == 2
    assert prof.module_stats(model).fwd_flops == 2 * (2 * 2 * 4 * 4)  # both calls of lin ran
    prof.end_profile()


def test_deepcopy_while_profiling_gives_an_unprofiled_working_copy():
    model = nn.Sequential(nn.Linear(4, 4))
    prof = FlopsProfiler(model)
    prof.start_profile()
    clone = copy.deepcopy(model)
    out = clone(torch.randn(2, 4))
    assert out.shape == (2, 4) and prof.get_total_flops() == 0  # the copy is another model
    model(torch.randn(2, 4))
    assert prof.get_total_flops() == 2 * 2 * 4 * 4
    prof.end_profile()
    assert clone[0].forward.__self__ is clone[0]


def test_fast_path_flag_is_validated():
    with pytest.raises(TypeError, match="fast_path"):
        FlopsProfiler(nn.Linear(2, 2), fast_path="yes")


@pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching rule"
)
def test_vmap_and_autocast_count_like_aten_level():
    # Under torch.func transforms the rules would see per-example shapes: counted at ATen level.
    torch.manual_seed(0)
    block = Block()

    class Vmapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            return torch.func.vmap(lambda z: self.block(z.unsqueeze(0)).squeeze(0))(x)

    assert_same_as_aten_level(Vmapped(), torch.randn(3, 5, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_same_as_aten_level(nn.Sequential(block), torch.randn(2, 5, 16))
        assert_same_as_aten_level(nn.Sequential(block), torch.randn(5, 2, 16).transpose(0, 1))
