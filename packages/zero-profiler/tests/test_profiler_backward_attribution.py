"""Per-module backward FLOPs: credited to the module whose forward created the running node.

The reference for a module's backward is the same module profiled alone, on an input of the same
shape and ``requires_grad``, where attribution is trivial (all of the backward is the module's).
Gradients that autograd has to sum (a tensor or a weight with several consumers) are credited to
the consumer whose node does the sum; the tests allow either consumer and check the sum exactly.
See [Note: exact backward attribution].
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from zero_profiler import FlopsProfiler


def profile_train(model, x, ignore=None):
    prof = FlopsProfiler(model)
    prof.track_backward = True
    prof.start_profile(ignore_list=ignore)
    out = model(x)
    out.backward(torch.ones_like(out))
    prof.stop_profile()
    return prof


def alone_bwd(module, shape, requires_grad):
    """Backward FLOPs of ``module`` profiled on its own."""
    x = torch.randn(shape, requires_grad=requires_grad)
    prof = profile_train(module, x)
    flops = prof.get_total_backward_flops()
    assert prof.module_stats(module).bwd_flops == flops
    prof.end_profile()
    module.zero_grad(set_to_none=True)
    return flops


def bwd(prof, module):
    return prof.module_stats(module).bwd_flops


class TwoBranch(nn.Module):
    """Two independent branches of different depth, joined by a concatenation."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 6))
        self.b = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 5))

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], dim=-1)


def test_parallel_branches_are_attributed_exactly():
    m = 4
    model = TwoBranch()
    ref_a = alone_bwd(model.a, (m, 8), False)
    ref_b = alone_bwd(model.b, (m, 8), False)
    prof = profile_train(model, torch.randn(m, 8))
    assert bwd(prof, model.a) == ref_a
    assert bwd(prof, model.b) == ref_b
    assert bwd(prof, model.a[2]) == 2 * m * 16 * 6 + 2 * m * 16 * 6 + m * 6  # dX, dW, db
    assert bwd(prof, model) == ref_a + ref_b == prof.get_total_backward_flops()
    prof.end_profile()


class TwoInput(nn.Module):
    """A block with two inputs and two branches; the shallow branch's backward runs first."""

    def __init__(self, shared: bool = False):
        super().__init__()
        self.deep = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        # shared: the shallow branch is the deep branch's first Linear, called a second time
        self.lin = self.deep[0] if shared else nn.Linear(8, 8)

    def forward(self, x1, x2):
        return self.deep(x2) + self.lin(x1)


class Mixer(nn.Module):
    """Feeds a learned tensor (a leaf) and a computed one into the two-input block."""

    def __init__(self, m: int, shared: bool = False):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(m, 8))
        self.pre = nn.Linear(8, 8)
        self.mix = TwoInput(shared)

    def forward(self, x):
        return self.mix(self.pos, self.pre(x))


def test_block_stays_active_until_all_its_branches_ran():
    # The gradient of the block's leaf input is complete (its AccumulateGrad runs at once) before
    # the deep branch has run: a tracker that ends the block on its first input gradient, as
    # torch.utils.module_tracker does, misses the deep branch.
    m = 3
    model = Mixer(m)
    refs = {name: alone_bwd(getattr(model.mix, name), (m, 8), True) for name in ("deep", "lin")}
    ref_pre = alone_bwd(nn.Linear(8, 8), (m, 8), False)
    prof = profile_train(model, torch.randn(m, 8))
    assert bwd(prof, model.mix.deep) == refs["deep"]
    assert bwd(prof, model.mix.lin) == refs["lin"]
    assert bwd(prof, model.mix) == refs["deep"] + refs["lin"]
    assert bwd(prof, model.pre) == ref_pre
    assert bwd(prof, model) == refs["deep"] + refs["lin"] + ref_pre == prof.get_total_backward_flops()
    prof.end_profile()


def test_shared_submodule_in_both_branches_of_a_block():
    m = 3
    model = Mixer(m, shared=True)
    shared = model.mix.lin
    ref_deep = alone_bwd(model.mix.deep, (m, 8), True)
    ref_lin = alone_bwd(shared, (m, 8), True)
    ref_pre = alone_bwd(nn.Linear(8, 8), (m, 8), False)
    prof = profile_train(model, torch.randn(m, 8))
    weight_sum = 8 * 8 + 8  # the two gradients of the shared weight and bias, summed
    assert bwd(prof, shared) == 2 * ref_lin + weight_sum
    assert bwd(prof, model.mix.deep[2]) == alone_bwd(nn.Linear(8, 8), (m, 8), True)
    assert bwd(prof, model.mix.deep) in (ref_deep, ref_deep + weight_sum)
    assert bwd(prof, model.mix) == ref_deep + ref_lin + weight_sum
    assert bwd(prof, model) == ref_deep + ref_lin + weight_sum + ref_pre == prof.get_total_backward_flops()
    prof.end_profile()


class Fan(nn.Module):
    """One module's output feeds two consumers; the right one is deeper."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.left = nn.Linear(8, 4)
        self.right = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        h = self.stem(x)
        return self.left(h) + self.right(h)


def test_output_feeding_two_consumers():
    m = 3
    model = Fan()
    ref_stem = alone_bwd(model.stem, (m, 8), False)
    ref_left = alone_bwd(model.left, (m, 8), True)
    ref_right = alone_bwd(model.right, (m, 8), True)
    prof = profile_train(model, torch.randn(m, 8))
    # The two gradients of h are summed (m * 8 FLOPs) by whichever consumer finishes last.
    fan_in_sum = m * 8
    assert bwd(prof, model.stem) == ref_stem
    assert {bwd(prof, model.left) - ref_left, bwd(prof, model.right) - ref_right} == {0, fan_in_sum}
    assert bwd(prof, model) == ref_stem + ref_left + ref_right + fan_in_sum
    assert bwd(prof, model) == prof.get_total_backward_flops()
    prof.end_profile()


class Head(nn.Module):
    def __init__(self, shared: nn.Linear, out: int):
        super().__init__()
        self.shared = shared
        self.head = nn.Linear(8, out)

    def forward(self, x):
        return self.head(torch.relu(self.shared(x)))


class SharedSub(nn.Module):
    """One Linear instance is a child of two parents; each parent calls it once."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(8, 8)
        self.p1 = Head(shared, 3)
        self.p2 = Head(shared, 5)

    def forward(self, x):
        return torch.cat([self.p1(x), self.p2(x)], dim=-1)


def test_shared_submodule_called_from_two_parents():
    m = 4
    model = SharedSub()
    shared = model.p1.shared
    ref_p1 = alone_bwd(Head(nn.Linear(8, 8), 3), (m, 8), False)
    ref_p2 = alone_bwd(Head(nn.Linear(8, 8), 5), (m, 8), False)
    ref_shared = alone_bwd(nn.Linear(8, 8), (m, 8), False)
    prof = profile_train(model, torch.randn(m, 8))
    # The two gradients of the shared weight and bias are summed by the shared Linear's node
    # that finishes last: 8 * 8 + 8 FLOPs, credited to it and to that call's parent.
    weight_sum = 8 * 8 + 8
    assert bwd(prof, shared) == 2 * ref_shared + weight_sum
    assert {bwd(prof, model.p1) - ref_p1, bwd(prof, model.p2) - ref_p2} == {0, weight_sum}
    assert bwd(prof, model.p1.head) == alone_bwd(nn.Linear(8, 3), (m, 8), True)
    assert bwd(prof, model) == ref_p1 + ref_p2 + weight_sum == prof.get_total_backward_flops()
    prof.end_profile()


class Stack(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2)
        )
        self.mode = mode

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            if self.mode == "plain":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x


def test_checkpointed_blocks_keep_their_backward():
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (2, 5))
    results = {}
    for mode in ("plain", "non-reentrant", "reentrant"):
        model = Stack(mode)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            prof = profile_train(model, ids)
        results[mode] = (
            [bwd(prof, b) for b in model.blocks],
            bwd(prof, model),
            prof.get_total_backward_flops(),
            prof.get_total_recompute_flops(),
        )
        prof.end_profile()
    plain_blocks, plain_root, plain_total, plain_recompute = results["plain"]
    assert plain_recompute == 0 and plain_blocks[0] > 0 and plain_root == plain_total
    for mode in ("non-reentrant", "reentrant"):
        blocks, root, total, recompute = results[mode]
        assert blocks == plain_blocks, mode
        assert root == total == plain_total, mode
        assert recompute > 0, mode


def test_ignored_module_backward_is_dropped_from_parents():
    m = 3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    x = torch.randn(m, 8)
    full = profile_train(model, x)
    ln_bwd = bwd(full, model[1])
    full_total = full.get_total_backward_flops()
    full.end_profile()
    model.zero_grad(set_to_none=True)
    assert ln_bwd > 0
    prof = profile_train(model, x, ignore=[nn.LayerNorm])
    assert bwd(prof, model[1]) == 0
    assert prof.get_total_backward_flops() == full_total - ln_bwd
    assert bwd(prof, model) == bwd(prof, model[0]) + bwd(prof, model[2]) == full_total - ln_bwd
    prof.end_profile()


def test_loss_backward_is_outside_the_model():
    model = nn.Linear(8, 4)
    prof = FlopsProfiler(model)
    prof.track_backward = True
    prof.start_profile()
    x = torch.randn(3, 8)
    loss = (model(x) ** 2).mean()  # pow and mean outside any module
    loss.backward()
    prof.stop_profile()
    assert bwd(prof, model) == prof.get_total_backward_flops() == alone_bwd(nn.Linear(8, 4), (3, 8), False)
    assert prof._tracker.totals.outside_flops > 0
    prof.end_profile()


class Box:
    """An output type that is no pytree: nothing can walk from it to the graph."""

    def __init__(self, t):
        self.t = t


class Boxed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return Box(self.lin(x) * 2)


class Unboxes(nn.Module):
    def __init__(self):
        super().__init__()
        self.boxed = Boxed()

    def forward(self, x):
        return self.boxed(x).t


def test_backward_attributed_whatever_the_output_type():
    m = 3
    model = Unboxes()
    prof = profile_train(model, torch.randn(m, 8))
    ref_lin = alone_bwd(nn.Linear(8, 8), (m, 8), False)
    assert bwd(prof, model.boxed.lin) == ref_lin
    assert bwd(prof, model.boxed) == ref_lin + m * 8  # the "* 2" of its forward: one mul per element
    assert bwd(prof, model) == prof.get_total_backward_flops() == ref_lin + m * 8
    prof.end_profile()


class SavesIntermediate(nn.Module):
    """Keeps a weak reference to an activation that only the autograd graph holds."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.refs = []

    def forward(self, x):
        y = self.lin(x) * 2
        self.refs.append(weakref.ref(y))
        return y.sin()  # SinBackward saves y


def test_profiling_keeps_no_graph_alive():
    model = nn.Sequential(SavesIntermediate(), nn.Linear(8, 4))
    prof = FlopsProfiler(model)
    prof.track_backward = True
    prof.start_profile()
    out = model(torch.randn(2, 8))
    ref = model[0].refs[0]
    assert ref() is not None
    del out  # never backpropagated: the graph and its saved activations must go now
    gc.collect()
    assert ref() is None
    prof.end_profile()
