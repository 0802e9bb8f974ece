"""Activation checkpointing: gradients equal the plain run (dropout included), for every storage option."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero_core import activation_checkpointing as ac
from zero_core.activation_checkpointing import checkpointing as ckpt_module
from zero_core.activation_checkpointing import rng as rng_module
from zero_core.activation_checkpointing import storage
from zero_core.testing import run_multirank


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Every test starts unconfigured, with empty buffers, profile and tracker."""
    monkeypatch.setattr(ckpt_module, "_STATE", ckpt_module.CheckpointingState())
    monkeypatch.setattr(rng_module, "_TRACKER", ac.CudaRNGStatesTracker())


class _Mpu:
    """A model-parallel unit over the default group (or a single process)."""

    def get_model_parallel_rank(self):
        return dist.get_rank() if dist.is_initialized() else 0

    def get_model_parallel_world_size(self):
        return dist.get_world_size() if dist.is_initialized() else 1

    def get_model_parallel_group(self):
        return dist.group.WORLD if dist.is_initialized() else None


class _Block(nn.Module):
    def __init__(self, width=16, p=0.3):
        super().__init__()
        self.fc1, self.fc2, self.drop = (
            nn.Linear(width, 2 * width),
            nn.Linear(2 * width, width),
            nn.Dropout(p),
        )

    def forward(self, x, scale=1.0, use_tracker=False):
        h = torch.nn.functional.gelu(self.fc1(x))
        if use_tracker:
            with ac.get_cuda_rng_tracker().fork():
                h = self.drop(h)
        else:
            h = self.drop(h)
        return x + scale * self.fc2(h)


def _model(seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.2, batch_first=True)
    return nn.ModuleList([_Block(), layer, _Block()])


def _grads(model, x, use_checkpoint, seed=123, **kw):
    """Loss and every gradient of one forward/backward, with each layer checkpointed or not."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    if kw.get("use_tracker"):
        ac.model_parallel_cuda_manual_seed(5)  # same tracked stream for both runs
    torch.manual_seed(seed)
    h = x
    for layer in model:
        extra = (kw.get("scale", 1.0), kw.get("use_tracker", False)) if isinstance(layer, _Block) else ()
        h = ac.checkpoint(layer, h, *extra) if use_checkpoint else layer(h, *extra)
    loss = h.square().mean()
    loss.backward()
    after = torch.rand(3)  # the RNG stream after backward must also match
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, (x.grad.clone() if x.grad is not None else None), after


def _assert_same(ref, got):
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
    assert len(ref[1]) == len(got[1])
    for i, (a, b) in enumerate(zip(ref[1], got[1])):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=f"parameter {i}")
    if ref[2] is not None:
        torch.testing.assert_close(got[2], ref[2], rtol=1e-6, atol=1e-7)
    assert torch.equal(ref[3], got[3])


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_gradients_match_plain_run_with_dropout(input_requires_grad):
    model = _model()
    x = torch.randn(2, 5, 16).requires_grad_(input_requires_grad)
    ref = _grads(model, x, use_checkpoint=False)
    got = _grads(model, x, use_checkpoint=True)
    _assert_same(ref, got)
    # Sanity: dropout is really active, so a different seed gives different gradients.
    other = _grads(model, x, use_checkpoint=False, seed=7)
    assert not torch.equal(other[1][0], ref[1][0])


def test_autocast_state_is_replayed_in_recompute():
    block = _Block(p=0.0)
    x = torch.randn(4, 16, requires_grad=True)
    results = []
    for use_checkpoint in (False, True):
        block.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ac.checkpoint(block, x) if use_checkpoint else block(x)
        out.float().square().sum().backward()
        results.append([p.grad.clone() for p in block.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_checkpoint_in_cpu_keeps_a_separate_copy():
    ac.configure(checkpoint_in_cpu=True)
    model = _model()
    x = torch.randn(2, 5, 16)
    ref = _grads(model, x, use_checkpoint=False)
    _assert_same(ref, _grads(model, x, use_checkpoint=True))
    # The saved input is a host copy: changing the caller's tensor after forward does not matter.
    block = _Block()
    inp = torch.randn(4, 16)
    torch.manual_seed(1)
    block(inp).sum().backward()
    want = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = ac.checkpoint(block, inp)
    inp.mul_(10)
    out.sum().backward()
    for a, p in zip(want, block.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-6, atol=1e-7)


def test_non_tensor_args_tuple_outputs_and_tracker_fork():
    model = _model()
    x = torch.randn(3, 16, requires_grad=True)
    ref = _grads(model[:1], x, use_checkpoint=False, scale=0.5, use_tracker=True)
    got = _grads(model[:1], x, use_checkpoint=True, scale=0.5, use_tracker=True)
    _assert_same(ref, got)

    lin = nn.Linear(4, 4)

    def fn(a, tag, mask, factor):
        assert tag == "hello" and mask is None
        y = lin(a) * factor
        return y, y.sum(), tag, torch.tensor([1, 2])

    a = torch.randn(2, 4, requires_grad=True)
    y, s, tag, ints = ac.checkpoint(fn, a, "hello", None, 3.0)
    assert tag == "hello" and ints.tolist() == [1, 2] and not ints.requires_grad
    (y.square().sum() + 2 * s).backward()
    a_ref = a.detach().clone().requires_grad_()
    lin_ref = nn.Linear(4, 4)
    lin_ref.load_state_dict(lin.state_dict())
    y_ref = lin_ref(a_ref) * 3.0
    (y_ref.square().sum() + 2 * y_ref.sum()).backward()
    torch.testing.assert_close(a.grad, a_ref.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lin.weight.grad, lin_ref.weight.grad, rtol=1e-6, atol=1e-7)


def test_no_grad_just_runs():
    block = _Block().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        out = ac.checkpoint(block, x)
        want = block(x)
    assert not out.requires_grad and out.grad_fn is None
    torch.testing.assert_close(out, want)
    assert ac.checkpoint(block, x).requires_grad  # with grad enabled it is recorded
    with pytest.raises(TypeError, match="must be callable"):
        ac.checkpoint("not a function", x)


def test_contiguous_buffers_profile_and_reset():
    ac.configure(contiguous_checkpointing=True, num_checkpoints=3, profile=True, synchronize=True)
    model = _model()
    x = torch.randn(2, 5, 16, requires_grad=True)
    _assert_same(_grads(model, x, use_checkpoint=False), _grads(model, x, use_checkpoint=True))
    _assert_same(
        _grads(model, x, use_checkpoint=False), _grads(model, x, use_checkpoint=True)
    )  # slots reused
    stats = ac.profile_stats()
    assert stats["forward"]["count"] == 6 and stats["backward"]["count"] == 6
    assert stats["forward"]["total_s"] > 0
    # Forward passes without backward fill the slots; reset() frees them.
    block = model[0]
    for _ in range(3):
        ac.checkpoint(block, x)
    with pytest.raises(RuntimeError, match="more than number_checkpoints=3"):
        ac.checkpoint(block, x)
    ac.reset()
    ac.checkpoint(block, x)
    with pytest.raises(ValueError, match="homogeneous"):
        ac.checkpoint(block, torch.randn(3, 16))


def test_configure_reads_dict_path_and_object(tmp_path):
    assert not ac.is_configured()
    section = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
               "number_checkpoints": 4, "synchronize_checkpoint_boundary": False, "profile": True}  # fmt: skip
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": section}))

    class Cfg:
        activation_checkpointing = ac.ActivationCheckpointingConfig(**section)

    for source in ({"activation_checkpointing": section}, str(path), path, Cfg()):
        ac.configure(mpu_=_Mpu(), deepspeed_config=source)
        assert ac.is_configured()
        cfg = ac.get_config()
        assert (cfg.partition_activations, cfg.cpu_checkpointing, cfg.number_checkpoints, cfg.profile) == (
            True, True, 4, True)  # fmt: skip
    # Explicit arguments override the file.
    ac.configure(deepspeed_config=path, checkpoint_in_cpu=False, num_checkpoints=9)
    assert ac.get_config().cpu_checkpointing is False and ac.get_config().number_checkpoints == 9
    assert ac.read_activation_checkpointing_config({}) == ac.ActivationCheckpointingConfig()


def test_configure_errors():
    with pytest.raises(ValueError, match=r"unknown keys \['cpu_checkpoint'\]; valid keys"):
        ac.configure(deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})
    with pytest.raises(ValueError, match="needs 'number_checkpoints'"):
        ac.configure(contiguous_checkpointing=True)
    with pytest.raises(TypeError, match="'profile' must be a bool"):
        ac.configure(profile="yes")
    with pytest.raises(TypeError, match=r"lacks the methods \['get_model_parallel_group'\]"):

        class Half:
            def get_model_parallel_rank(self):
                return 0

            def get_model_parallel_world_size(self):
                return 1

        ac.configure(mpu_=Half())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ac.configure(deepspeed_config="/nonexistent/ds.json")
    with pytest.raises(TypeError, match="must be a dict, a path"):
        ac.configure(deepspeed_config=42)
    assert not ac.is_configured()


def test_rng_tracker_fork_and_model_parallel_seed():
    tracker = ac.get_cuda_rng_tracker()
    tracker.add("a", 11)
    outer = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer)  # the outer stream is untouched
    with tracker.fork("a"):
        second = torch.rand(4)
    torch.manual_seed(11)
    assert torch.equal(torch.cat([first, second]), torch.rand(8))  # the tracked stream continues
    with pytest.raises(ValueError, match="seed 11 already exists"):
        tracker.add("b", 11)
    with pytest.raises(KeyError, match="'zzz' is not added"):
        with tracker.fork("zzz"):
            pass

    class Rank1(_Mpu):
        def get_model_parallel_rank(self):
            return 1

    draws = {}
    for name, mpu in (("r0", _Mpu()), ("r1", Rank1())):
        ac.model_parallel_cuda_manual_seed(42, mpu=mpu)
        default = torch.rand(2)
        with ac.get_cuda_rng_tracker().fork():
            draws[name] = (default, torch.rand(2))
    assert torch.equal(draws["r0"][0], draws["r1"][0])  # data-parallel stream: same on every mp rank
    assert not torch.equal(draws["r0"][1], draws["r1"][1])  # model-parallel stream: differs
    torch.manual_seed(42 + 2718 + 1)
    assert torch.equal(draws["r1"][1], torch.rand(2))


def test_partition_with_world_size_one_mpu():
    ac.configure(mpu_=_Mpu(), partition_activations=True, checkpoint_in_cpu=True)
    model = _model()
    x = torch.randn(2, 5, 16)
    _assert_same(_grads(model, x, use_checkpoint=False), _grads(model, x, use_checkpoint=True))


def _partitioned_rank():
    mpu = _Mpu()
    cfg = ac.ActivationCheckpointingConfig(partition_activations=True)
    t = torch.arange(15, dtype=torch.float32).reshape(3, 5)  # 15 elements: uneven split, padded to 16
    saved = storage.save_inputs([t], cfg, mpu, storage.ContiguousBuffers())
    assert saved[0].partitioned and saved[0].data.numel() == 8
    rebuilt = storage.load_inputs(saved, mpu)[0]
    assert torch.equal(rebuilt, t)

    ac.configure(mpu_=mpu, partition_activations=True, checkpoint_in_cpu=True)
    model = _model()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    _assert_same(_grads(model, x, use_checkpoint=False), _grads(model, x, use_checkpoint=True))
    return saved[0].data.tolist()


def test_partition_activations_two_ranks():
    parts = run_multirank(_partitioned_rank, 2, timeout=60.0)
    assert parts == [[0.0, 1, 2, 3, 4, 5, 6, 7], [8.0, 9, 10, 11, 12, 13, 14, 0]]
