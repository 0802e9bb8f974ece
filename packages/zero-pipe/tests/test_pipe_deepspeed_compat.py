"""DeepSpeed users' pipeline code, unchanged: a PipelineModule subclass through initialize,
train_batch() over initialize's training_data, the steps_per_print line, dynamic_shape, and an
in-place op on a received activation. Each trajectory is checked against one process training
the same nn.Sequential (fp32)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

DIM, MB, GAS, LR = 6, 2, 2, 0.1


class Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(16, DIM, generator=g)
        self.y = torch.randint(0, 3, (16,), generator=g)

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def specs():
    return [
        LayerSpec(nn.Linear, DIM, DIM),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, DIM, DIM),
        LayerSpec(nn.Linear, DIM, 3),
    ]


class MyPipe(PipelineModule):
    """A user's subclass, as DeepSpeedExamples' GPT-NeoX-style models write them."""

    def __init__(self, **kw):
        super().__init__(specs(), num_stages=2, loss_fn=nn.functional.cross_entropy, seed_layers=True, **kw)


def reference(layer_specs):
    layers = []
    for idx, spec in enumerate(layer_specs):
        torch.manual_seed(1234 + idx)  # seed_layers: layer idx is built under base_seed + idx
        layers.append(spec.build())
    return nn.Sequential(*layers)


def _reference_losses(batches):
    """One process, the same SGD, the micro-batches in the order initialize's loader yields them."""
    ds = Pairs()
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    sampler.set_epoch(0)
    order = list(sampler)
    model = reference(specs())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for b in range(batches):
        opt.zero_grad()
        total = 0.0
        for m in range(GAS):
            idx = order[(b * GAS + m) * MB : (b * GAS + m + 1) * MB]
            loss = nn.functional.cross_entropy(model(ds.x[idx]), ds.y[idx])
            (loss / GAS).backward()
            total += loss.item() / GAS
        opt.step()
        losses.append(total)
    return losses


def _subclass_rank():
    from zero_core import initialize

    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "steps_per_print": 2,
        "gradient_clipping": 0.0,
    }
    engine, _, _, _ = initialize(model=MyPipe(), config=cfg, training_data=Pairs())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = [engine.train_batch().item() for _ in range(3)]
    return type(engine) is PipelineEngine, losses, out.getvalue()


def test_subclass_initialize_train_batch_over_training_data_and_progress_line():
    expected = _reference_losses(3)
    results = run_multirank(_subclass_rank, 2, timeout=240)
    for rank, (is_pipe, losses, printed) in enumerate(results):
        assert is_pipe, "a PipelineModule subclass must get the PipelineEngine"
        assert losses == pytest.approx(expected, rel=1e-5)
        lines = [ln for ln in printed.splitlines() if ln.startswith("steps:")]
        if rank == 0:  # DeepSpeed's line, at step 2 only (steps_per_print=2, 3 batches)
            assert len(lines) == 1, printed
            m = re.fullmatch(
                r"steps: 2 loss: (\d+\.\d{4}) iter time \(s\): \d+\.\d{3} samples/sec: \d+\.\d{3}", lines[0]
            )
            assert m and float(m.group(1)) == pytest.approx(expected[1], abs=1e-4)
        else:
            assert lines == []


def _empty_cache_rank(save_dir):
    from zero_core import initialize

    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "gradient_clipping": 0.0,
    }
    engine, _, _, _ = initialize(model=MyPipe(), config=cfg, training_data=Pairs())
    # DeepSpeed's checkpoint tests call it on every engine they build, pipelines included:
    # right after initialize, after training and before saving.
    assert engine.empty_partition_cache() is None
    # DeepSpeed's engine attributes those tests use: the device to build data on, the skipped-step
    # counter, and set_dataloader (training continues from a fresh iterator over the loader)
    assert engine.device == torch.device("cpu") and engine.skipped_steps == 0
    assert engine.sparse_tensor_module_names == set()
    # the engine walks its stage's module as DeepSpeed's nn.Module engine does
    assert [id(p) for p in engine.parameters()] == [id(p) for p in engine.module.parameters()]
    assert [n for n, _ in engine.named_parameters()] == [n for n, _ in engine.module.named_parameters()]
    assert list(engine.modules())[0] is engine.module and list(engine.buffers()) == list(
        engine.module.buffers()
    )
    losses = []
    for _ in range(3):
        losses.append(engine.train_batch().item())
        engine.empty_partition_cache()
    engine.save_checkpoint(save_dir, tag="t")
    # set_dataloader: train_batch() then draws its micro-batches from that loader
    fixed = [(Pairs().x[:MB], Pairs().y[:MB])] * GAS
    want = engine.eval_batch(iter(fixed)).item()
    engine.set_dataloader(fixed)
    assert engine.train_batch().item() == pytest.approx(want, rel=1e-6)
    with pytest.raises(TypeError, match="set_dataloader: expected an iterable"):
        engine.set_dataloader(3)
    return losses


def test_empty_partition_cache_on_the_pipeline_engine(tmp_path):
    # A no-op for a pipeline stage (ZeRO stage 0/1 keeps no gathered copies): the trajectory is
    # the one of a run without the calls, and saving afterwards works.
    expected = _reference_losses(3)
    for losses in run_multirank(_empty_cache_rank, 2, args=(str(tmp_path),), timeout=240):
        assert losses == pytest.approx(expected, rel=1e-5)
    assert (tmp_path / "t").is_dir()


class Scale(nn.Module):
    """An in-place op on its input: the received activation when it starts a stage."""

    def forward(self, x):
        return x.mul_(2.0)


class SeqHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 3)

    def forward(self, x):  # (mb, T, DIM) -> (mb, 3): any sequence length
        return self.proj(x.mean(1))


def seq_specs():
    # (a Linear before Scale: its backward does not need its output, so the one-process
    # reference may modify it in place too)
    return [
        LayerSpec(nn.Linear, DIM, DIM),
        LayerSpec(nn.Linear, DIM, DIM),
        LayerSpec(Scale),
        LayerSpec(SeqHead),
    ]


def seq_data():
    g = torch.Generator().manual_seed(1)
    lengths = [3, 5, 2, 7, 4, 6]  # a different sequence length in every micro-batch
    return [(torch.randn(MB, t, DIM, generator=g), torch.randint(0, 3, (MB,), generator=g)) for t in lengths]


def _dynamic_rank():
    model = PipelineModule(
        seq_specs(),
        num_stages=2,
        loss_fn=nn.functional.cross_entropy,
        seed_layers=True,
        partition_method="uniform",
        dynamic_shape=True,
    )
    assert model.stage_id == 0 or type(model.layer_modules()[2]) is Scale  # stage 1 starts in place
    engine = PipelineEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS},
    )
    data = seq_data()
    return [engine.train_batch(iter(data[b * GAS : (b + 1) * GAS])).item() for b in range(3)]


def test_dynamic_shape_and_in_place_op_on_received_activation():
    model = reference(seq_specs())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = seq_data()
    expected = []
    for b in range(3):
        opt.zero_grad()
        total = 0.0
        for x, y in data[b * GAS : (b + 1) * GAS]:
            loss = nn.functional.cross_entropy(model(x.clone()), y)
            (loss / GAS).backward()
            total += loss.item() / GAS
        opt.step()
        expected.append(total)
    for losses in run_multirank(_dynamic_rank, 2, timeout=240):
        assert losses == pytest.approx(expected, rel=1e-5)
