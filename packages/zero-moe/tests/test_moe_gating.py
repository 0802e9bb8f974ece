"""Gating arithmetic: capacity, dropping, dropless counts, l_aux, exp_counts, RTS, noise, used_token."""

from __future__ import annotations

import math

import pytest
import torch
from zero_moe import TopKGate, compute_capacity, topk_gating

# Four tokens, two experts, gate probabilities chosen by hand (logits = log p).
PROBS = torch.tensor([[0.75, 0.25], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]])
LOGITS = PROBS.log()


def test_capacity_arithmetic():
    assert compute_capacity(4, 2, 1.0, 0) == 2
    assert compute_capacity(4, 2, 1.0, 0, k=2) == 4
    assert compute_capacity(10, 4, 1.0, 0) == 3  # ceil(2.5)
    assert compute_capacity(10, 4, 1.25, 0) == 4  # ceil(3.125)
    assert compute_capacity(10, 4, 1.0, 8) == 8  # min_capacity wins
    assert compute_capacity(7, 3, 2.0, 1, k=3) == math.ceil(7 / 3 * 2.0 * 3)
    with pytest.raises(ValueError, match="capacity_factor"):
        compute_capacity(4, 2, 0.0, 1)
    with pytest.raises(ValueError, match="num_tokens"):
        compute_capacity(0, 2, 1.0, 1)


def test_l_aux_hand_computed():
    out = topk_gating(LOGITS, 1, 100.0, 0, use_rts=False)
    # me = mean probs = [0.6125, 0.3875]; ce = first-choice fractions = [3/4, 1/4]; l_aux = E * sum(me * ce)
    expected = 2 * (0.6125 * 0.75 + 0.3875 * 0.25)
    assert out.l_aux.item() == pytest.approx(expected, rel=1e-6)
    # top-2 uses the same loss (DeepSpeed: mean(me*ce) * E * E == E * sum(me*ce))
    out2 = topk_gating(LOGITS, 2, 100.0, 0, use_rts=False)
    assert out2.l_aux.item() == pytest.approx(expected, rel=1e-6)


def test_top1_dropping_by_position():
    out = topk_gating(LOGITS, 1, 1.0, 0, use_rts=False)
    assert out.capacity == 2
    assert out.exp_counts.tolist() == [3, 1]  # counted before dropping
    assert out.keep[:, 0].tolist() == [True, True, True, False]  # token 3 is third in line for expert 0
    torch.testing.assert_close(out.weights[:, 0], torch.tensor([0.75, 0.6, 0.8, 0.0]))  # raw probs for k=1
    assert out.position[:, 0].tolist()[:3] == [0, 1, 0]
    assert out.counts.tolist() == [2, 1]
    combine = out.combine_weights()
    assert combine.shape == (4, 2, 2)
    assert combine.sum().item() == pytest.approx(0.75 + 0.6 + 0.8)
    assert out.dispatch_mask().sum().item() == 3


def test_min_capacity_prevents_dropping():
    out = topk_gating(LOGITS, 1, 1.0, 4, use_rts=False)
    assert out.capacity == 4
    assert out.keep.all()


def test_top2_choice_major_dropping_and_renormalisation():
    out = topk_gating(LOGITS, 2, 0.5, 0, use_rts=False)
    assert out.capacity == 2
    assert out.expert_idx.tolist() == [[0, 1], [0, 1], [1, 0], [0, 1]]
    assert out.exp_counts.tolist() == [4, 4]
    # Expert 0 takes first choices of tokens 0, 1; expert 1 takes token 2's first, then token 0's second.
    assert out.keep.tolist() == [[True, True], [True, False], [True, False], [False, False]]
    torch.testing.assert_close(
        out.weights, torch.tensor([[0.75, 0.25], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]), rtol=1e-6, atol=1e-7
    )


def test_topk_weights_sum_to_one_without_drops():
    torch.manual_seed(0)
    logits = torch.randn(20, 6)
    for k in (2, 3, 4):
        out = topk_gating(logits, k, 100.0, 0, use_rts=False)
        assert out.keep.all()
        torch.testing.assert_close(out.weights.sum(1), torch.ones(20))
        ref = torch.softmax(logits, 1).topk(k, dim=1)
        assert torch.equal(out.expert_idx.sort(1).values, ref.indices.sort(1).values)
        assert out.exp_counts.sum().item() == 20 * k


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_keeps_every_token(k):
    torch.manual_seed(1)
    logits = torch.randn(64, 4) * 3  # skewed loads
    padded = topk_gating(logits, k, 0.1, 0, drop_tokens=False, ragged=False, use_rts=False)
    ragged = topk_gating(logits, k, 0.1, 0, drop_tokens=False, ragged=True, use_rts=False)
    for out in (padded, ragged):
        assert out.keep.all()
        assert out.counts.sum().item() == 64 * k
        assert torch.equal(out.counts, out.exp_counts)
        assert out.order.numel() == 64 * k
    assert padded.capacity == int(padded.exp_counts.max())
    assert ragged.capacity is None
    dropping = topk_gating(logits, k, 0.1, 0, drop_tokens=True, use_rts=False)
    assert dropping.counts.sum().item() < 64 * k
    assert torch.all(dropping.counts <= dropping.capacity)
    assert torch.equal(dropping.exp_counts, padded.exp_counts)


def test_random_token_selection_is_unbiased():
    kept_last = 0
    for seed in range(40):
        torch.manual_seed(seed)
        out = topk_gating(LOGITS, 1, 1.0, 0, use_rts=True)
        assert out.keep[[0, 1, 3], 0].sum().item() == 2  # expert 0 still holds exactly capacity tokens
        kept_last += int(out.keep[3, 0])
    # Without RTS token 3 is never kept; with RTS it is kept about 2/3 of the time.
    assert 10 <= kept_last <= 38


def test_used_token_masks_routing():
    used = torch.tensor([1, 0, 1, 1])
    out = topk_gating(LOGITS, 1, 100.0, 0, used_token=used, use_rts=False)
    assert out.keep[:, 0].tolist() == [True, False, True, True]
    assert out.weights[1].abs().sum().item() == 0
    assert out.exp_counts.tolist() == [2, 1]
    # ce counts only used tokens but still divides by all S tokens (DeepSpeed's definition)
    expected = 2 * (0.6125 * 2 / 4 + 0.3875 * 1 / 4)
    assert out.l_aux.item() == pytest.approx(expected, rel=1e-6)


def test_noise_policies_only_in_training():
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    for policy in ("Jitter", "RSample"):
        gate = TopKGate(
            8,
            4,
            k=1,
            capacity_factor=100.0,
            eval_capacity_factor=100.0,
            noisy_gate_policy=policy,
            use_rts=False,
        )
        gate.eval()
        a, b = gate(x), gate(x)
        assert torch.equal(a.weights, b.weights) and torch.equal(a.expert_idx, b.expert_idx)
        gate.train()
        outs = [gate(x) for _ in range(5)]
        if policy == "Jitter":
            # weights move a little (inputs scaled by U(0.99, 1.01)) where the choice did not flip
            same = (outs[0].expert_idx == a.expert_idx)[:, 0]
            diff = (outs[0].weights - a.weights)[same].abs().max().item()
            assert 0 < diff < 0.1
        else:
            # selections change; weights are the noiseless probabilities of the chosen experts
            assert any(not torch.equal(o.expert_idx, a.expert_idx) for o in outs)
            probs = torch.softmax(x @ gate.wg.weight.t(), 1)
            for o in outs:
                torch.testing.assert_close(o.weights, probs.gather(1, o.expert_idx))


def test_second_expert_sampling_switch():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    sampled = TopKGate(8, 6, k=2, capacity_factor=100.0, use_rts=False, top2_2nd_expert_sampling=True)
    plain = TopKGate(8, 6, k=2, capacity_factor=100.0, use_rts=False, top2_2nd_expert_sampling=False)
    plain.load_state_dict(sampled.state_dict())
    ref = plain(x)
    assert torch.equal(plain(x).expert_idx, ref.expert_idx)
    noisy = sampled(x)
    assert torch.equal(noisy.expert_idx[:, 0], ref.expert_idx[:, 0])  # first choice never sampled
    assert not torch.equal(noisy.expert_idx[:, 1], ref.expert_idx[:, 1])


def test_gating_input_validation():
    with pytest.raises(ValueError, match="k must be"):
        topk_gating(LOGITS, 3, 1.0, 0)
    with pytest.raises(ValueError, match="no tokens"):
        topk_gating(torch.zeros(0, 2), 1, 1.0, 0)
    with pytest.raises(ValueError, match="logits must be"):
        topk_gating(torch.zeros(2, 2, 2), 1, 1.0, 0)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(4, 2, noisy_gate_policy="Gaussian")
