"""``ZeroTrainer``: Hugging Face's ``transformers.Trainer`` with its model trained by a zero engine.

[Note: Trainer under zero]
transformers drives DeepSpeed through accelerate's DeepSpeed plugin, which needs the
``deepspeed`` package. ``ZeroTrainer`` keeps everything of the Trainer (data loading and
sharding through accelerate, callbacks, logging, evaluation loop) and hands the model's
training to :func:`zero.initialize` instead, at the one place the Trainer prepares the model
and optimizer (``_prepare_for_training``):

* the engine is built from ``zero_config`` (a DeepSpeed-format config); what the config leaves
  out is filled from ``TrainingArguments`` as transformers' DeepSpeed integration fills its
  ``"auto"`` values: micro batch, gradient accumulation, gradient clipping (``max_grad_norm``),
  ``"auto"`` optimizer and scheduler parameters (``lr``, ``betas``, ``eps``, ``weight_decay``,
  ``warmup_*``, ``total_num_steps``), and, when the config has no ``optimizer`` / ``scheduler`` section, AdamW with the arguments'
  learning rate, betas, epsilon and weight decay and ``transformers.get_scheduler`` of
  ``lr_scheduler_type`` with its warm-up;
* each micro-batch's loss (the model's mean loss) goes through ``engine.backward`` and
  ``engine.step``, which steps the optimizer, the scheduler and clipping at accumulation
  boundaries, as the engine does in a user's own loop. The Trainer's own optimizer and scheduler
  calls are then no-ops on views of the engine's (``learning_rate`` and ``grad_norm`` in the
  logs come from the engine);
* ``save_model`` writes ``save_16bit_model``'s files, the model config and the processing
  class (what ``from_pretrained`` loads); Trainer checkpoints (``save_strategy``) hold, under
  ``checkpoint-<step>``, the engine's ``save_checkpoint``, every rank's random generators and
  ``trainer_state.json``, all safetensors + JSON, and ``train(resume_from_checkpoint=...)``
  continues from them at any world size and stage. See [Note: Trainer checkpoints] in
  ``hf_trainer_checkpoint.py``.

So the logged training loss of a ``ZeroTrainer`` run equals that of the same model, data and
config in a plain zero loop (``tests/test_hf_integration.py``), and a run resumed from one of
its checkpoints continues it exactly (``tests/test_hf_trainer_checkpoints.py``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import transformers

import zero_core
from zero_core.config.loader import read_config
from zero_core.integrations.hf_trainer_checkpoint import TrainerCheckpoints

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT
    from torch.utils.data import DataLoader

    from zero_core.config.loader import ConfigSource
    from zero_core.engine.engine import ZeroEngine


class _EngineOptimizer:
    """What the Trainer's loop sees as its optimizer: the engine's param groups; stepping and
    zeroing belong to the engine. See [Note: Trainer under zero]."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    def step(self, closure: Callable[[], float] | None = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()


class _EngineScheduler:
    """The Trainer's view of the learning rate: the engine's (its scheduler steps in the engine)."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine

    def step(self, *args: object, **kwargs: object) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return self.engine.get_lr()

    def state_dict(self) -> dict[str, Any]:
        sched = self.engine.lr_scheduler
        return sched.state_dict() if sched is not None else {}


class ZeroTrainer(TrainerCheckpoints, transformers.Trainer):
    """``transformers.Trainer`` training its model with a zero engine (any ZeRO stage).

    ``zero_config``: a DeepSpeed-format config (dict or file path). Build the model inside
    ``zero.Init`` (or with :func:`zero.integrations.from_pretrained`) for stage 3, as with
    DeepSpeed. Every other argument is the Trainer's. See [Note: Trainer under zero].
    """

    def __init__(self, *args: Any, zero_config: ConfigSource, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.save_only_model and self.args.load_best_model_at_end:
            # as the Trainer refuses it for DeepSpeed: loading the best model loads its engine state
            raise ValueError(
                "ZeroTrainer: save_only_model=True writes no engine checkpoint, which "
                "load_best_model_at_end=True loads; set one of them to False"
            )
        raw, _ = read_config(zero_config)  # the user's keys only: fills below need what is absent
        self.zero_config = raw
        self.engine: ZeroEngine | None = None
        # The engine reduces at its own accumulation boundaries (and refuses no_sync at stages
        # 2/3, as DeepSpeed does): accelerate's no_sync around the non-final micro-batches of an
        # accumulation window must not reach it (accelerate skips it for DeepSpeed engines too).
        self.accelerator.no_sync = lambda model=None: contextlib.nullcontext()

    # -- the engine ----------------------------------------------------------------------
    def _engine_config(self) -> dict[str, Any]:
        """``zero_config`` with what it leaves out (or sets to "auto") taken from the arguments."""
        cfg, a = copy.deepcopy(self.zero_config), self.args
        fills = {
            "train_micro_batch_size_per_gpu": a.per_device_train_batch_size,
            "gradient_accumulation_steps": a.gradient_accumulation_steps,
            "gradient_clipping": a.max_grad_norm,
        }
        for key, value in fills.items():
            if cfg.get(key, "auto") == "auto":
                cfg[key] = value
            elif key != "gradient_clipping" and cfg[key] != value:
                raise ValueError(
                    f"ZeroTrainer: zero_config {key}={cfg[key]} disagrees with TrainingArguments ({value}); "
                    'set one of them (or "auto" in the config)'
                )
        if cfg.get("train_batch_size") == "auto":
            del cfg["train_batch_size"]
        return cfg

    def _fill_auto_params(self, cfg: dict[str, Any], max_steps: int) -> None:
        """``"auto"`` optimizer/scheduler parameters from the arguments, as transformers fills
        them for DeepSpeed (an HF-style config: ``"lr": "auto"``, ``"warmup_num_steps": "auto"``)."""
        a = self.args
        values = {
            "lr": a.learning_rate,
            "betas": [a.adam_beta1, a.adam_beta2],
            "eps": a.adam_epsilon,
            "weight_decay": a.weight_decay,
            "warmup_min_lr": 0.0,
            "warmup_max_lr": a.learning_rate,
            "warmup_num_steps": a.get_warmup_steps(max_steps),
            "total_num_steps": max_steps,
        }
        for section in ("optimizer", "scheduler"):
            params = (cfg.get(section) or {}).get("params") or {}
            for key, value in list(params.items()):
                if value == "auto" and key in values:
                    params[key] = values[key]

    def _build_engine(self, max_steps: int) -> ZeroEngine:
        cfg, a = self._engine_config(), self.args
        self._fill_auto_params(cfg, max_steps)
        optimizer = None
        if "optimizer" not in cfg:

            def optimizer(params: ParamsT) -> torch.optim.Optimizer:
                return torch.optim.AdamW(
                    params,
                    lr=a.learning_rate,
                    betas=(a.adam_beta1, a.adam_beta2),
                    eps=a.adam_epsilon,
                    weight_decay=a.weight_decay,
                )

        scheduler = None
        if "scheduler" not in cfg:

            def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
                return transformers.get_scheduler(
                    a.lr_scheduler_type,
                    opt,
                    num_warmup_steps=a.get_warmup_steps(max_steps),
                    num_training_steps=max_steps,
                )

        engine, *_ = zero_core.initialize(
            model=self.model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg
        )
        return engine

    # -- the Trainer's hooks -------------------------------------------------------------
    def _prepare_for_training(
        self, max_steps: int, train_dataloader: DataLoader, resume_from_checkpoint: str | bool | None
    ) -> tuple[ZeroEngine, DataLoader]:
        if self.engine is None:
            self.engine = self._build_engine(max_steps)
        if resume_from_checkpoint is not None:  # where the Trainer loads DeepSpeed's checkpoint
            self._load_engine_checkpoint(resume_from_checkpoint)
        self.model_wrapped = self.engine
        self.optimizer = _EngineOptimizer(self.engine)
        self.lr_scheduler = _EngineScheduler(self.engine)
        return self.engine, train_dataloader

    def _wrap_model(
        self, model: torch.nn.Module, training: bool = True, dataloader: DataLoader | None = None
    ) -> torch.nn.Module:
        return self.engine if self.engine is not None else model

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """One micro-batch: the model's mean loss through ``engine.backward`` / ``engine.step``;
        returns the loss divided by the accumulation steps (what the Trainer sums for its log)."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)  # per micro-batch mean: the engine scales it
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach() / self.current_gradient_accumulation_steps

    def _clip_grad_norm(self, model: torch.nn.Module) -> float | None:
        return self._get_grad_norm(model)

    def _get_grad_norm(
        self, model: torch.nn.Module, grad_norm: float | torch.Tensor | None = None
    ) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The 16-bit weights (``save_16bit_model``: collective), the model config and the
        processing class, as ``from_pretrained`` loads them.

        In a checkpoint (``_internal_call``) at stage 3 without
        ``gather_16bit_weights_on_model_save`` the weights are left to the engine's checkpoint
        (``zero_to_fp32`` recovers them), as the Trainer's DeepSpeed path does."""
        output_dir = output_dir or self.args.output_dir
        if self.engine is None:
            super().save_model(output_dir, _internal_call)
            return
        partitioned = (
            self.engine.zero_optimization_stage() == 3
            and not self.engine.zero_gather_16bit_weights_on_model_save()
        )
        if _internal_call and partitioned:
            if self.args.save_only_model:
                raise ValueError(
                    "ZeroTrainer: save_only_model=True at ZeRO stage 3 needs "
                    "zero_optimization.gather_16bit_weights_on_model_save=true, or the checkpoint "
                    "would hold no weights"
                )
        else:
            self.engine.save_16bit_model(output_dir)
        if self.args.should_save:
            if hasattr(self.model, "config"):
                self.model.config.save_pretrained(output_dir)
            if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(output_dir)
