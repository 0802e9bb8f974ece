"""The fast path counts exactly what ATen-level counting counts, operator by operator.

Every rule of ``function_formulas.FUNCTION_RULES`` is run on calls it accepts and on calls it must
decline; each is profiled twice, with the fast path and with ``fast_path=False`` (every ATen
operator through the dispatch mode), and FLOPs, MACs and the per-operator table must be equal.
Where a rule should apply, the test also checks the call did not fall back to ATen level, so a
rule that silently stopped matching is caught as well.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from profiler_models import Fn
from zero_profiler import FlopsProfiler
from zero_profiler.function_formulas import FUNCTION_RULES, PASS, Pointwise


def profile(model, args, fast_path, train=False):
    prof = FlopsProfiler(model, fast_path=fast_path)
    prof.track_backward = train
    prof.start_profile()
    mode = prof._tracker._mode
    with torch.set_grad_enabled(train):
        out = model(*args)
        if train:
            torch.autograd.backward(out, torch.ones_like(out))
    prof.stop_profile()
    result = dict(
        fwd=(prof.get_total_flops(), prof.get_total_macs()),
        bwd=prof.get_total_backward_flops(),
        by_op=prof.get_flops_by_op(),
        modules={name: prof.module_stats(m).fwd_flops for name, m in model.named_modules()},
    )
    prof.end_profile()
    return result, mode


def compare(fn, *args, expect_fast=None, train=False, params=()):
    """Fast path vs ATen level on ``fn(*args)`` inside a module; returns the fast-path counts.

    ``expect_fast``: a function that must have been counted by its rule (not at ATen level),
    ``True`` when nothing at all may go to ATen level, ``False`` when something must.
    ``params``: tensors outside ``args`` that collect gradients in train mode (reset between runs).
    """
    model = Fn(fn)
    if train:
        args = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
    for a in (*args, *params):
        a.grad = None
    fast, mode = profile(model, args, fast_path=True, train=train)
    for a in (*args, *params):
        a.grad = None
    slow, _ = profile(model, args, fast_path=False, train=train)
    assert fast == slow
    aten_level = set(mode.aten_level_calls) - {torch.Tensor.backward, torch.autograd.backward}
    if expect_fast is False:
        assert aten_level, "expected the call to be counted at ATen level"
    elif expect_fast is True:
        assert not aten_level, aten_level
    elif expect_fast is not None:
        assert expect_fast in FUNCTION_RULES and expect_fast not in aten_level, aten_level
    return fast


def t(*shape, **kw):
    return torch.randn(*shape, **kw)


# --- products -----------------------------------------------------------------------------------

W, B = t(12, 8), t(12)


@pytest.mark.parametrize(
    "x, bias, fast",
    [
        (t(5, 8), B, True),  # addmm
        (t(2, 5, 8), B, True),  # contiguous 3-d: flattened addmm
        (t(2, 3, 5, 8), B, True),  # contiguous N-d with a 1-d bias
        (t(8), B, True),  # 1-d input
        (t(5, 8), None, True),  # mm
        (t(2, 5, 8), None, True),  # folded into mm
        (t(5, 2, 8).transpose(0, 1), B, False),  # non-contiguous: matmul + separate add
        (t(5, 2, 8).transpose(0, 1), None, False),  # batch strides do not fold: bmm
        (t(5, 1, 8).transpose(0, 1), None, False),  # size-1 dim with odd stride: does not fold
        (t(5, 1, 8).transpose(0, 1), B, True),  # ... but is "contiguous": flattened addmm
    ],
)
def test_linear_rule(x, bias, fast):
    counts = compare(lambda z: F.linear(z, W, bias), x, expect_fast=F.linear if fast else False)
    assert counts["fwd"][1] == x.numel() // 8 * 8 * 12


def test_linear_rule_keyword_and_train():
    compare(lambda z: F.linear(input=z, weight=W, bias=B), t(3, 8), expect_fast=F.linear)
    # in grad mode a weight that requires grad folds a non-contiguous batch too
    weight = nn.Parameter(t(12, 8))
    compare(lambda z: F.linear(z, weight), t(5, 2, 8).transpose(0, 1), train=True, params=[weight])
    compare(lambda z: F.linear(z, weight, B), t(4, 8), train=True, params=[weight], expect_fast=F.linear)


@pytest.mark.parametrize(
    "a, b, fast",
    [
        (t(7), t(7), True),  # dot
        (t(3, 7), t(7), True),  # mv
        (t(7), t(7, 4), True),  # mm on an unsqueezed vector
        (t(3, 7), t(7, 4), True),  # mm
        (t(2, 3, 7), t(2, 7, 4), True),  # bmm
        (t(2, 1, 3, 7), t(5, 7, 4), True),  # broadcast batch: bmm
        (t(2, 3, 7), t(7, 4), True),  # folded mm
        (t(2, 3, 7), t(7), True),  # folded mv
        (t(3, 2, 7).transpose(0, 1), t(7, 4), False),  # batch does not fold
        (t(3, 7), t(2, 7, 4), False),  # matrix times batch
    ],
)
def test_matmul_rule(a, b, fast):
    expect = torch.matmul if fast else False
    compare(torch.matmul, a, b, expect_fast=expect)
    compare(lambda x, y: x @ y, a, b)


def test_matmul_weight_requiring_grad_folds():
    weight = nn.Parameter(t(7, 4))
    compare(lambda x: torch.matmul(x, weight), t(3, 2, 7).transpose(0, 1), expect_fast=torch.matmul)


def test_mm_family():
    a, b, c = t(3, 5), t(5, 4), t(3, 4)
    compare(torch.mm, a, b, expect_fast=torch.mm)
    compare(lambda x, y: x.mm(y), a, b, expect_fast=torch.Tensor.mm)
    compare(torch.addmm, c, a, b, expect_fast=torch.addmm)
    compare(lambda z, x, y: torch.addmm(z, x, y, beta=0.5, alpha=2.0), c, a, b, expect_fast=torch.addmm)
    ba, bb, bc = t(2, 3, 5), t(2, 5, 4), t(2, 3, 4)
    compare(torch.bmm, ba, bb, expect_fast=torch.bmm)
    compare(torch.baddbmm, bc, ba, bb, expect_fast=torch.baddbmm)
    compare(lambda x, y: x.addmm_(a, b) + y, c.clone(), c, expect_fast=False)  # addmm_: no rule


# --- pointwise, reductions, softmax, norms ------------------------------------------------------

X, Y = t(2, 3, 4), t(3, 4)


@pytest.mark.parametrize(
    "fn, func",
    [
        (lambda x, y: x + y, torch.Tensor.add),  # broadcast: counted per output element
        (lambda x, y: torch.add(x, y, alpha=2), torch.add),
        (lambda x, y: x - y, torch.Tensor.sub),
        (lambda x, y: 1 - x, torch.Tensor.__rsub__),
        (lambda x, y: x * 2.5, torch.Tensor.mul),
        (lambda x, y: x / y, torch.Tensor.div),
        (lambda x, y: torch.div(x, y, rounding_mode="floor"), torch.div),
        (lambda x, y: -x, torch.Tensor.neg),
        (lambda x, y: x**2, torch.Tensor.pow),
        (lambda x, y: torch.pow(2.0, x), torch.pow),
        (lambda x, y: x.abs().sqrt(), torch.Tensor.sqrt),
        (lambda x, y: x.abs().rsqrt() + x.exp() + x.abs().log() + x.sin() + x.cos(), torch.Tensor.rsqrt),
        (lambda x, y: torch.tanh(x) + torch.sigmoid(x) + torch.relu(x) + torch.erf(x), torch.tanh),
        (lambda x, y: x.clamp(-0.5, 0.5) + x.reciprocal(), torch.Tensor.clamp),
        (lambda x, y: x.clone().add_(y).mul_(2).sub_(1).div_(3).neg_().clamp_(0, 1), torch.Tensor.add_),
        (lambda x, y: x.clone().tanh_().sigmoid_().relu_().pow_(2), torch.Tensor.tanh_),
        (lambda x, y: x.clone().__iadd__(y), torch.Tensor.add_),
        (lambda x, y: F.gelu(x) + F.gelu(x, approximate="tanh"), F.gelu),
        (lambda x, y: F.relu(x) + F.relu(x.clone(), inplace=True), F.relu),
        (lambda x, y: F.silu(x) + F.silu(x.clone(), inplace=True), F.silu),
        (lambda x, y: F.tanh(x) + F.sigmoid(x), torch.Tensor.tanh),
        (lambda x, y: x.sum() + x.mean(-1).sum(), torch.Tensor.sum),
        (lambda x, y: torch.sum(x, dim=1, dtype=torch.float64), torch.sum),
        (lambda x, y: x.var(-1, correction=0) + torch.mean(x), torch.Tensor.var),
        (lambda x, y: F.softmax(x, -1) + x.softmax(0) + torch.softmax(x, 1), F.softmax),
        (lambda x, y: F.softmax(x, -1, dtype=torch.float64), F.softmax),
        (lambda x, y: F.log_softmax(x, -1) + x.log_softmax(-1), F.log_softmax),
    ],
)
def test_pointwise_reduction_softmax_rules(fn, func):
    compare(fn, X, Y, expect_fast=func)


def test_norm_rules():
    x = t(4, 6, 5)
    w, b = t(5), t(5)
    compare(lambda z: F.layer_norm(z, (5,), w, b), x, expect_fast=F.layer_norm)
    compare(lambda z: F.layer_norm(z, (6, 5)), x, expect_fast=F.layer_norm)  # no affine: 4/element
    compare(lambda z: torch.layer_norm(z, (5,), w, None, 1e-5, False), x, expect_fast=torch.layer_norm)
    compare(lambda z: F.group_norm(z, 2, t(6), t(6)), x, expect_fast=F.group_norm)
    compare(lambda z: F.group_norm(z, 3), x, expect_fast=F.group_norm)
    mean, var, gw, gb = torch.zeros(6), torch.ones(6), t(6), t(6)
    compare(lambda z: F.batch_norm(z, mean, var, gw, gb), x, expect_fast=F.batch_norm)
    compare(lambda z: F.batch_norm(z, None, None, training=True), x, expect_fast=F.batch_norm)
    compare(lambda z: F.batch_norm(z, mean.clone(), var.clone(), gw, gb, training=True), x)


def test_dropout_rule():
    x = t(4, 5)
    compare(lambda z: F.dropout(z, 0.3, training=False) * 2, x, expect_fast=F.dropout)
    compare(lambda z: F.dropout(z, 0.0), x, expect_fast=F.dropout)
    torch.manual_seed(0)
    fast = compare(lambda z: F.dropout(z, 0.3), x, expect_fast=False)  # training: mask and scale
    assert fast["fwd"][0] > 0


# --- convolutions and attention -----------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(
    "fn, x",
    [
        (lambda z: F.conv1d(z, t(6, 2, 3), t(6), stride=2, groups=2), t(2, 4, 11)),
        (lambda z: F.conv2d(z, t(5, 3, 3, 2), padding=1, dilation=2), t(2, 3, 9, 8)),
        (lambda z: F.conv2d(z, t(5, 3, 4, 4), padding="same"), t(2, 3, 9, 8)),  # asymmetric pad
        (lambda z: F.conv2d(z, t(5, 3, 3, 3)), t(3, 9, 8)),  # unbatched
        (lambda z: F.conv3d(z, t(4, 2, 2, 2, 2), stride=(1, 2, 1)), t(1, 2, 5, 6, 4)),
        (lambda z: F.conv_transpose1d(z, t(4, 3, 3), stride=2, output_padding=1), t(2, 4, 7)),
        (lambda z: F.conv_transpose2d(z, t(4, 2, 3, 3), groups=2, stride=2), t(2, 4, 5, 5)),
        (lambda z: F.conv_transpose3d(z, t(2, 3, 2, 2, 2)), t(1, 2, 4, 3, 3)),
    ],
)
def test_convolution_rules(fn, x):
    counts = compare(fn, x, expect_fast=None)
    assert counts["fwd"][1] > 0
    assert counts["by_op"] == {torch.ops.aten.convolution: counts["fwd"][0]}


@pytest.mark.parametrize(
    "kwargs, shapes, fast",
    [
        ({}, ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)), True),
        ({}, ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)), False),  # value head size differs: math
        ({"is_causal": True}, ((1, 4, 6, 8),) * 3, True),
        ({"attn_mask": torch.ones(6, 6, dtype=torch.bool).tril()}, ((1, 2, 6, 8),) * 3, True),
        ({"attn_mask": torch.randn(6, 6)}, ((1, 2, 6, 8),) * 3, True),
        ({"scale": 0.3}, ((1, 2, 6, 8),) * 3, True),
        ({"enable_gqa": True}, ((1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)), None),
        ({}, ((3, 5, 8), (3, 7, 8), (3, 7, 8)), False),  # 3-d: the math path, at ATen level
    ],
)
def test_sdpa_rule(kwargs, shapes, fast):
    q, k, v = (t(*s) for s in shapes)
    expect = F.scaled_dot_product_attention if fast else fast
    compare(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kwargs), q, k, v, expect_fast=expect)


def test_sdpa_with_dropout_in_training_goes_to_aten_level():
    q = t(1, 2, 6, 8)
    torch.manual_seed(0)
    compare(
        lambda a: F.scaled_dot_product_attention(a, a, a, dropout_p=0.5), q, train=True, expect_fast=False
    )


# --- no counted operator ------------------------------------------------------------------------


def test_pass_functions_count_nothing_and_stay_on_the_fast_path():
    ids = torch.tensor([[1, 2], [0, 3]])
    emb = t(5, 4)

    def shuffle(x):
        y = x.view(6, 4).reshape(2, 12).transpose(0, 1).permute(1, 0).contiguous()
        a, b = y.split(6, dim=1)
        c = torch.cat([a, b], 0).unsqueeze(0).squeeze(0).flatten().unflatten(0, (3, 8))
        d = torch.stack(torch.chunk(c, 2, 1)).clone().to(torch.float64).float()
        d[0, 0] = 1.0
        d = d.masked_fill(d > 0, 0.5).expand(2, 3, 4).narrow(2, 0, 2).flip(0).roll(1, 0)
        e = torch.where(d > 0, d, torch.zeros_like(d)).tril() + 0 * d.new_ones(d.shape).triu()
        z = F.embedding(ids, emb, max_norm=1.0) + F.pad(torch.arange(4.0), (0, 0)).sum()
        n = x.shape[0] + x.dim() + x.size(1) + x.numel() + len(x) + int(x.sum().item() > 0)
        return e.sum() + z.sum() + n

    fast = compare(shuffle, X, expect_fast=True)
    # only the explicitly arithmetic calls are counted (adds, sums, the multiplication)
    assert set(fast["by_op"]) <= {torch.ops.aten.add, torch.ops.aten.sum, torch.ops.aten.mul}


def test_pass_entries_are_never_counted_operators():
    # A PASS entry must not be an operator with a FLOP formula under another spelling.
    from zero_profiler.flop_formulas import FORMULAS

    counted = {str(packet).split(".")[-1] for packet in FORMULAS}
    for func, rule in FUNCTION_RULES.items():
        if rule is PASS:
            assert getattr(func, "__name__", "") not in counted, func


def test_pointwise_entries_name_their_operator():
    # torch.add, Tensor.add_, F.gelu, Tensor.__rsub__ ... each run the ATen operator of their name.
    for func, rule in FUNCTION_RULES.items():
        if isinstance(rule, Pointwise):
            name = func.__name__
            name = name[2:-2] if name.startswith("__") else name
            assert str(rule.packet) == f"aten.{name}", func


# --- calls without a rule -----------------------------------------------------------------------


def test_functions_without_a_rule_are_counted_exactly_at_aten_level():
    a, b = t(2, 3, 4), t(2, 4, 5)
    counts = compare(lambda x, y: torch.einsum("bij,bjk->bik", x, y), a, b, expect_fast=False)
    assert counts["fwd"] == (2 * 2 * 3 * 4 * 5, 2 * 3 * 4 * 5)
    x = t(3, 8)
    compare(lambda z: F.rms_norm(z, (8,), torch.ones(8)), x, expect_fast=False)
    compare(lambda z: torch.cdist(z, z), x, expect_fast=False)
    compare(lambda z: F.cross_entropy(z, torch.tensor([1, 2, 3])), x, expect_fast=False)
    compare(lambda z: torch.ops.aten.mm.default(z, z.t()), x, expect_fast=False)
    compare(lambda z: 2 / z, x, expect_fast=False)  # __rtruediv__: reciprocal and mul


class Logged(torch.Tensor):
    """A subclass with its own __torch_function__: calls on it must not take the fast path."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclass_is_counted_at_aten_level():
    x = t(3, 8).as_subclass(Logged)
    counts = compare(lambda z: F.linear(z, W, B) + z.sum(), x, expect_fast=False)
    assert counts["fwd"][1] == 3 * 8 * 12
