"""FLOP counts of the profiler against analytic formulas and torch.utils.flop_counter."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from profiler_models import Block, Fn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode
from zero_profiler import FlopsProfiler, get_model_profile


def fwd_flops(model, *args, **kwargs):
    flops, macs, _ = get_model_profile(
        model, args=list(args), kwargs=kwargs, print_profile=False, as_string=False, warm_up=0
    )
    return flops, macs


# --- tiny GPT ------------------------------------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, vocab=64, c=32, h=4, layers=2, ctx=16, checkpointed=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(ctx, c)
        self.blocks = nn.ModuleList(Block(c, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        self.checkpointed = checkpointed

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])
        x = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head: a functional call


def block_flops(b, t, c, h):
    bt = b * t
    attn = 2 * b * h * t * t * 2 * (c // h) + b * h * t * t
    return (
        5 * bt * c  # ln1
        + 2 * bt * c * 3 * c  # qkv
        + attn
        + 2 * bt * c * c  # proj
        + bt * c  # residual
        + 5 * bt * c  # ln2
        + 2 * bt * c * 4 * c  # fc
        + bt * 4 * c  # gelu
        + 2 * bt * 4 * c * c  # fc2
        + bt * c  # residual
    )


def gpt_flops(b, t, c, h, layers, vocab):
    return b * t * c + layers * block_flops(b, t, c, h) + 5 * b * t * c + 2 * b * t * c * vocab


# --- single operators ----------------------------------------------------------------------------


def test_linear_counts_2mnk():
    lin = nn.Linear(24, 40)
    flops, macs = fwd_flops(lin, torch.randn(3, 5, 24))
    assert macs == 15 * 24 * 40
    assert flops == 2 * macs


def test_conv2d_counts_out_elements_times_kernel_volume():
    conv = nn.Conv2d(6, 8, kernel_size=3, stride=2, padding=1, groups=2)
    x = torch.randn(2, 6, 9, 9)
    out = conv(x)
    macs = out.numel() * (6 // 2) * 9
    assert fwd_flops(conv, x) == (2 * macs, macs)


def test_conv_transpose_counts_input_elements_times_kernel_volume():
    conv = nn.ConvTranspose1d(4, 6, kernel_size=3, stride=2)
    x = torch.randn(2, 4, 7)
    macs = x.numel() * 6 * 3
    assert fwd_flops(conv, x) == (2 * macs, macs)


def test_matmul_operator_bmm_and_einsum():
    a, b = torch.randn(4, 5, 6), torch.randn(4, 6, 7)
    macs = 4 * 5 * 6 * 7
    assert fwd_flops(Fn(lambda x, y: x @ y), a, b) == (2 * macs, macs)
    assert fwd_flops(Fn(torch.bmm), a, b) == (2 * macs, macs)
    assert fwd_flops(Fn(torch.matmul), a, b) == (2 * macs, macs)
    assert fwd_flops(Fn(lambda x, y: torch.einsum("bij,bjk->bik", x, y)), a, b) == (2 * macs, macs)
    # einsum with a contraction over two indices
    x, w = torch.randn(3, 4, 5), torch.randn(4, 5, 6)
    assert fwd_flops(Fn(lambda p, q: torch.einsum("bij,ijk->bk", p, q)), x, w)[1] == 3 * 20 * 6


def test_sdpa_equals_explicit_attention():
    b, h, lq, lk, e = 2, 3, 5, 7, 8
    q, k, v = torch.randn(b, h, lq, e), torch.randn(b, h, lk, e), torch.randn(b, h, lk, e)
    expected_macs = b * h * lq * lk * 2 * e
    expected = 2 * expected_macs + b * h * lq * lk
    fused = fwd_flops(Fn(F.scaled_dot_product_attention), q, k, v)
    explicit = fwd_flops(Fn(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v), q, k, v)
    assert fused == (expected, expected_macs)
    assert explicit == (expected, expected_macs)


def test_gpt_block_and_full_gpt_exact():
    b, t, c, h, vocab = 2, 8, 32, 4, 64
    block = Block(c, h)
    assert fwd_flops(block, torch.randn(b, t, c))[0] == block_flops(b, t, c, h)
    gpt = GPT(vocab=vocab, c=c, h=h, layers=2)
    ids = torch.randint(0, vocab, (b, t))
    assert fwd_flops(gpt, ids)[0] == gpt_flops(b, t, c, h, 2, vocab)


def test_functional_calls_are_attributed_to_the_module_that_ran_them():
    b, t, c, h, vocab = 2, 8, 32, 4, 64
    gpt = GPT(vocab=vocab, c=c, h=h, layers=2)
    prof = FlopsProfiler(gpt)
    prof.start_profile()
    with torch.no_grad():
        gpt(torch.randint(0, vocab, (b, t)))
    prof.stop_profile()
    blk = prof.module_stats(gpt.blocks[0])
    # The block's own functional SDPA, GELU and residual adds are inside its count.
    assert blk.fwd_flops == block_flops(b, t, c, h)
    assert prof.module_stats(gpt.blocks[0].qkv).fwd_macs == b * t * c * 3 * c
    # The tied head is F.linear in the root's forward: in the root, not in any child.
    children = sum(prof.module_stats(m).fwd_flops for m in (gpt.wte, gpt.wpe, gpt.ln_f, *gpt.blocks))
    assert prof.module_stats(gpt).fwd_flops - children == b * t * c + 2 * b * t * c * vocab
    assert prof.get_total_flops() == gpt_flops(b, t, c, h, 2, vocab)
    prof.end_profile()


def test_shared_parameters_counted_once():
    gpt = GPT(vocab=64, c=32, h=4, layers=1)
    _, _, params = get_model_profile(
        gpt, args=[torch.randint(0, 64, (1, 4))], print_profile=False, as_string=False
    )
    assert params == sum(p.numel() for p in gpt.parameters())  # parameters() dedupes the tied weight
    lin = nn.Linear(8, 8, bias=False)
    twice = nn.Sequential(lin, lin)
    assert get_model_profile(twice, input_shape=(2, 8), print_profile=False, as_string=False)[2] == 64


def test_module_called_twice_counts_both_calls():
    lin = nn.Linear(8, 8, bias=False)
    twice = nn.Sequential(lin, lin)
    assert fwd_flops(twice, torch.randn(2, 8))[1] == 2 * 2 * 64


def test_agrees_with_torch_flop_counter_forward_and_backward():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 10, bias=False),
        Fn(lambda z: torch.einsum("bij,bkj->bik", z.view(2, 2, 5), z.view(2, 2, 5))),
        Fn(lambda z: z @ z),
    )
    x = torch.randn(2, 3, 8, 8)
    for train in (False, True):
        with FlopCounterMode(display=False) as fc:
            out = model(x)
            if train:
                out.backward(torch.ones_like(out))
        model.zero_grad()
        theirs = fc.get_flop_counts()["Global"]
        prof = FlopsProfiler(model)
        prof.track_backward = train
        prof.start_profile()
        out = model(x)
        if train:
            out.backward(torch.ones_like(out))
        prof.stop_profile()
        ours = prof.get_flops_by_op()
        assert set(theirs) >= {torch.ops.aten.convolution, torch.ops.aten.mm, torch.ops.aten.bmm}
        for op, flops in theirs.items():
            assert ours.get(op, 0) == flops, (op, train)
        prof.end_profile()


def test_train_mode_counts_backward_exactly():
    # Bias-free MLP, input without grad: layer 1 backward = grad_weight only; layer 2 = both.
    m, d1, d2, d3 = 6, 5, 7, 3
    mlp = nn.Sequential(nn.Linear(d1, d2, bias=False), nn.Linear(d2, d3, bias=False))
    x = torch.randn(m, d1)
    prof = FlopsProfiler(mlp)
    prof.track_backward = True
    prof.start_profile()
    mlp(x).backward(torch.ones(m, d3))
    prof.stop_profile()
    fwd = 2 * m * d1 * d2 + 2 * m * d2 * d3
    assert prof.get_total_flops() == fwd
    assert prof.get_total_backward_flops() == 2 * m * d1 * d2 + 2 * (2 * m * d2 * d3)
    # backward is attributed to the module whose backward ran it
    assert prof.module_stats(mlp[0]).bwd_flops == 2 * m * d1 * d2
    assert prof.module_stats(mlp[1]).bwd_flops == 4 * m * d2 * d3
    assert prof.get_total_train_flops() == fwd + prof.get_total_backward_flops()
    prof.end_profile()


def test_activation_checkpointing_recompute_is_measured():
    b, t, c, h, vocab = 1, 8, 32, 4, 64
    gpt = GPT(vocab=vocab, c=c, h=h, layers=2, checkpointed=True)
    prof = FlopsProfiler(gpt)
    prof.track_backward = True
    prof.start_profile()
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # replay whole blocks
        gpt(torch.randint(0, vocab, (b, t))).sum().backward()
    prof.stop_profile()
    assert prof.get_total_flops() == gpt_flops(b, t, c, h, 2, vocab)
    assert prof.get_total_recompute_flops() == 2 * block_flops(b, t, c, h)
    assert prof.get_total_backward_flops() > 2 * prof.get_total_flops() * 0.9
    prof.end_profile()


def test_estimate_without_backward_uses_recompute_factor():
    lin = nn.Linear(4, 4, bias=False)
    prof = FlopsProfiler(lin, recompute_fwd_factor=0.5)
    prof.start_profile()
    lin(torch.randn(2, 4))
    prof.stop_profile()
    assert prof.get_total_train_flops() == round(3.5 * 2 * 2 * 16)
    prof.end_profile()


@pytest.mark.parametrize("ignored", [nn.LayerNorm])
def test_ignore_list_excludes_module_work(ignored):
    b, t, c, h = 1, 4, 16, 2
    block = Block(c, h)
    flops, _, _ = get_model_profile(
        block, args=[torch.randn(b, t, c)], print_profile=False, as_string=False, ignore_modules=[ignored]
    )
    assert flops == block_flops(b, t, c, h) - 2 * 5 * b * t * c
