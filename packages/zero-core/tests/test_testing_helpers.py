"""The shared parity-test helpers: zero_core.testing.models and zero_core.testing.parity."""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import MLPClassifier, TinyLM, classification_batch, token_batch
from zero_core.testing.parity import (
    assert_states_equal,
    assert_trajectory_close,
    state_snapshot,
    train_engine,
    train_reference,
)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_tiny_lm_variants_have_the_documented_layout():
    # the attention variant is the model of test_stage12_parity: 2887 trainable elements
    assert _count(TinyLM(32, 16, 23, attention=True)) == 2887
    assert [n for n, _ in TinyLM(32, 16, 24, mlp="two_layer", norm=False, unused=True).named_children()] == [
        "emb",
        "l1",
        "l2",
        "head",
        "unused",
    ]
    one = TinyLM(16, 8, 12, mlp="one_layer", norm=False)
    assert one.l2 is None and one.head.in_features == 12
    x, y = token_batch(0, 3, 5, 16)
    assert torch.isinf(one(x, y, poison=True)) and torch.isfinite(one(x, y))


def test_tiny_lm_same_seed_same_weights_and_variants_differ():
    torch.manual_seed(0)
    a = TinyLM()
    torch.manual_seed(0)
    b = TinyLM()
    assert_states_equal(b.state_dict(), a.state_dict())
    x, y = token_batch(1, 4, 8, 32)
    residual = a(x, y)
    plain = TinyLM(mlp="two_layer")
    plain.load_state_dict(a.state_dict())
    assert not torch.equal(plain(x, y), residual)  # the residual connection is really there


def test_models_reject_bad_arguments():
    with pytest.raises(ValueError, match="mlp must be one of"):
        TinyLM(mlp="three_layer")
    with pytest.raises(ValueError, match="hidden must be an int >= 1"):
        TinyLM(32, 16, 0)
    with pytest.raises(ValueError, match="n_classes must be an int >= 1"):
        MLPClassifier(4, 8, 0)
    with pytest.raises(ValueError, match="rows must be an int >= 1"):
        token_batch(0, 0, 8, 32)


def test_batches_are_seeded_and_in_range():
    x, y = token_batch(7, 4, 6, 10)
    assert x.shape == y.shape == (4, 6) and int(x.max()) < 10 and int(x.min()) >= 0
    assert all(torch.equal(a, b) for a, b in zip((x, y), token_batch(7, 4, 6, 10)))
    assert not torch.equal(x, token_batch(8, 4, 6, 10)[0])
    f, c = classification_batch(3, 5, 12, 4)
    assert f.shape == (5, 12) and f.dtype == torch.float32 and c.shape == (5,) and int(c.max()) < 4
    before = torch.get_rng_state()
    token_batch(1, 2, 2, 2)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is not touched


def test_comparisons_fail_outside_tolerance_and_name_the_key():
    state = {"w": torch.ones(3)}
    near = {"w": torch.ones(3) * (1 + 1e-7)}
    assert_trajectory_close([1.0], near, [1.0], state, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="w, case 3"):
        assert_trajectory_close(
            [1.0], {"w": torch.ones(3) * 1.1}, [1.0], state, rtol=1e-5, atol=1e-6, where="case 3"
        )
    with pytest.raises(AssertionError, match="losses"):
        assert_trajectory_close([1.1], state, [1.0], state, rtol=1e-5, atol=1e-6)
    with pytest.raises(KeyError):
        assert_trajectory_close([1.0], {}, [1.0], state, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="w"):
        assert_states_equal(near, state)


def test_state_snapshot_is_a_detached_copy():
    model = torch.nn.Linear(2, 2)
    snap = state_snapshot(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(snap["weight"], model.weight) and not snap["weight"].requires_grad
    with pytest.raises(TypeError, match="torch.nn.Module"):
        state_snapshot({"weight": model.weight})


def _engine_rank(gas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import zero_core
    from zero_core import comm

    world = comm.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10**6}
    engine, *_ = zero_core.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
    )
    losses = train_engine(
        engine, lambda s: token_batch(s, world * gas * 2, 8, 32), range(1, 4), micro=2, gas=gas
    )
    return losses, state_snapshot(model)


@pytest.mark.parametrize("world,gas", [(1, 3), (2, 2)])
def test_train_engine_covers_the_global_batch_like_the_reference(world: int, gas: int):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_losses, ref_state = train_reference(
        model, opt, lambda s: token_batch(s, world * gas * 2, 8, 32), range(1, 4)
    )
    for losses, state in run_multirank(_engine_rank, world, args=(gas,), timeout=120):
        assert_trajectory_close(losses, state, ref_losses, ref_state, rtol=1e-5, atol=1e-6)


def test_train_functions_reject_bad_arguments():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="steps must be an int >= 0 or a range"):
        train_reference(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda s: None, -1)
    with pytest.raises(ValueError, match="clip must be a number >= 0"):
        train_reference(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda s: None, 1, clip=-1.0)
    with pytest.raises(ValueError, match="micro must be an int >= 1"):
        train_engine(object(), lambda s: None, 1, micro=0)
