"""``zero_core.initialize(model=PipelineModule)`` hands over to zero-pipe and trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineConfigError, PipelineEngine, PipelineModule, PipelineSectionConfig

DIM, MB = 6, 2


def specs():
    return [
        LayerSpec(nn.Linear, DIM, DIM),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, DIM, DIM),
        LayerSpec(nn.Linear, DIM, 3),
    ]


class Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, DIM, generator=g)
        self.y = torch.randint(0, 3, (64,), generator=g)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _init_rank():
    from zero_core import initialize
    from zero_pipe import RepeatingLoader

    model = PipelineModule(specs(), num_stages=2, loss_fn=nn.functional.cross_entropy, seed_layers=True)
    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 2},
        },
        "pipeline": {"stages": 2, "activation_checkpoint_interval": 1},
        "gradient_clipping": 0.0,
    }
    engine, opt, loader, sched = initialize(model=model, config=cfg, training_data=Pairs())
    it = RepeatingLoader(loader)
    fixed = [(Pairs().x[i * MB : (i + 1) * MB], Pairs().y[i * MB : (i + 1) * MB]) for i in range(4)]
    before = engine.eval_batch(iter(fixed)).item()
    for _ in range(12):
        engine.train_batch(it)
    losses = [before, engine.eval_batch(iter(fixed)).item()]
    bad = PipelineModule(specs(), num_stages=2, loss_fn=nn.functional.cross_entropy)
    try:
        initialize(model=bad, config={**cfg, "pipeline": {"stages": 4}})
        err = None
    except PipelineConfigError as e:
        err = str(e)
    # progressive layer drop needs keyword arguments in the model's forward, which a pipeline's
    # stages never get (DeepSpeed's pipeline then fails with a TypeError): refused up front
    pld = {**cfg, "progressive_layer_drop": {"enabled": True, "theta": 0.5}}
    with pytest.raises(PipelineConfigError, match="progressive_layer_drop: the pipeline engine cannot pass"):
        initialize(
            model=PipelineModule(specs(), num_stages=2, loss_fn=nn.functional.cross_entropy), config=pld
        )
    return (
        type(engine) is PipelineEngine,
        opt is engine.optimizer,
        sched is engine.lr_scheduler,
        losses,
        isinstance(engine.config.pipeline, PipelineSectionConfig),
        model.activation_checkpoint_interval,
        err,
    )


def test_initialize_builds_pipeline_engine_from_config():
    for is_engine, same_opt, same_sched, losses, typed, interval, err in run_multirank(_init_rank, 2):
        assert is_engine and same_opt and same_sched and typed and interval == 1
        assert losses[-1] < losses[0]
        assert err is not None and "pipeline.stages=4" in err


def _onebit_rank():
    import pytest
    from zero_core import initialize

    model = PipelineModule(specs(), num_stages=2, loss_fn=nn.functional.cross_entropy)
    cfg = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 0.05, "freeze_step": 2}},
        "pipeline": {"stages": 2},
    }
    with pytest.raises(ValueError, match="plain data parallelism only.*pipeline parallelism"):
        initialize(model=model, config=cfg)


def test_compressed_optimizers_are_refused_with_a_pipeline():
    # 1-bit Adam and its kin run on plain data parallelism only (as in DeepSpeed)
    run_multirank(_onebit_rank, 2, timeout=120)
