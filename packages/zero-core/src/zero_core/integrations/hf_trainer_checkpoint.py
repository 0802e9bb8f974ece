"""What ``ZeroTrainer`` writes in the Trainer's ``checkpoint-N`` folders, and how it resumes.

[Note: Trainer checkpoints]
transformers' ``Trainer._save_checkpoint`` runs a fixed sequence of overridable parts:
``save_model`` (what ``from_pretrained`` loads), ``_save_optimizer_and_scheduler``,
``_save_scaler`` and ``_save_rng_state`` (torch pickles there: ``optimizer.pt``,
``scheduler.pt``, ``scaler.pt``, ``rng_state[_<i>].pth``; its DeepSpeed path writes the
engine's ``save_checkpoint`` instead of the optimizer file), then ``trainer_state.json``
(JSON), then ``rotate_checkpoints`` (``save_total_limit``: oldest first, never the newest nor
the best). ``ZeroTrainer`` keeps the sequence and replaces the parts, so no file is a pickle::

    checkpoint-N/
      model.safetensors, config.json     save_model: the engine's save_16bit_model (skipped at
                                         stage 3 without gather_16bit_weights_on_model_save)
      latest, global_stepN/, zero_to_fp32.py
                                         engine.save_checkpoint: weights, fp32 masters, optimizer
                                         states, LR scheduler, loss scaler, counters (safetensors
                                         + JSON; loads at any world size and ZeRO stage)
      rng_state_<rank>.safetensors/.json every process's random generators (checkpoint/rng.py)
      trainer_state.json                 the Trainer's own

Resuming, ``train(resume_from_checkpoint=path or True)``: the Trainer calls
``_load_from_checkpoint`` before the engine exists (for a plain model it loads the weights
there); ours only checks that the folder holds an engine checkpoint. The engine loads it in
``_prepare_for_training`` right after it is built (where the Trainer loads DeepSpeed's). The
Trainer then restores ``trainer_state.json`` (step, epoch, logs, best metric), skips the
batches of the current epoch it already trained on, and only then calls ``_load_rng_state``,
since making the data iterator draws from torch's generator; ours restores the generators
from the rank's RNG files. The continued run therefore sees the batches and random numbers
of the uninterrupted one. At another world size (keep the global batch: per-device batch x
accumulation x ranks) the engine reshards, the Trainer's skip counts the same global steps,
and each process keeps its own generators (a saved rank is not a resumed rank's twin), which
only random layers such as dropout notice; the Trainer too leaves them alone when a rank's file
is missing.

``load_best_model_at_end``: ``_load_best_model`` loads the best checkpoint's engine state
(weights, masters, optimizer, scheduler), as the Trainer's DeepSpeed path loads DeepSpeed's.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING

from zero_core.checkpoint import rng
from zero_core.checkpoint.format import COMMIT_FILE, CheckpointError
from zero_core.checkpoint.loader import resolve_tag

if TYPE_CHECKING:
    import torch
    import transformers

    from zero_core.engine.engine import ZeroEngine

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"  # the Trainer's TRAINER_STATE_NAME
RNG_FILE = "rng_state"  # rng_state_<rank>.safetensors / .json, as the Trainer's rng_state_<rank>.pth
_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def check_trainer_checkpoint(path: str | os.PathLike[str]) -> str:
    """``path`` as a str when it is a ``ZeroTrainer`` checkpoint folder (one with a complete
    engine checkpoint); otherwise a ``ValueError`` saying what is missing."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"resume_from_checkpoint must be a path or True, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"Can't find a valid checkpoint at {path}: no such directory")
    try:
        tag = resolve_tag(path, None)
    except CheckpointError as e:
        raise ValueError(f"Can't find a valid checkpoint at {path}: {e}") from None
    if tag is None:
        weights_only = any(os.path.isfile(os.path.join(path, f)) for f in _MODEL_FILES)
        hint = (
            " It holds model weights only (saved with save_only_model=True, or by another Trainer): "
            "start a new run from them (from_pretrained) instead of resuming."
            if weights_only
            else ""
        )
        raise ValueError(
            f"Can't find a valid checkpoint at {path}: a ZeroTrainer checkpoint holds the engine's "
            f"checkpoint (a 'latest' file naming its tag folder, written by engine.save_checkpoint).{hint}"
        )
    if not os.path.isfile(os.path.join(path, tag, COMMIT_FILE)):
        raise ValueError(
            f"Can't find a valid checkpoint at {path}: 'latest' names {tag!r}, but "
            f"{os.path.join(path, tag, COMMIT_FILE)} is missing (an incomplete save?)"
        )
    if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
        raise ValueError(
            f"Can't find a valid checkpoint at {path}: it has the engine's checkpoint but no "
            f"{TRAINER_STATE} (the Trainer's step, epoch and logs, written last: the save was "
            "interrupted); resume from an earlier checkpoint"
        )
    return path


class TrainerCheckpoints:
    """The Trainer's checkpoint hooks for ``ZeroTrainer`` (which defines ``engine``): see
    [Note: Trainer checkpoints]. Mixed in before ``transformers.Trainer``."""

    engine: ZeroEngine | None
    args: transformers.TrainingArguments
    state: transformers.TrainerState

    # -- saving ---------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (optimizer, scheduler, masters, loss scaler) in ``output_dir``
        (collective: every rank calls it, as ``_save_checkpoint`` does). Its ``client_state``
        records the global batch, which a resume at another layout must keep."""
        self.engine.save_checkpoint(
            output_dir,
            tag=f"global_step{self.state.global_step}",
            client_state={"train_batch_size": self.engine.train_batch_size()},
        )

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the engine's loss scaler is in its checkpoint (the Trainer pickles its own)."""

    def _save_rng_state(self, output_dir: str) -> None:
        """Every process's generators as safetensors + JSON (the Trainer pickles them)."""
        os.makedirs(output_dir, exist_ok=True)
        rng.save_rank_file(output_dir, RNG_FILE, self.args.process_index, self.args.world_size)

    # -- resuming -------------------------------------------------------------------------
    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        """Check the folder only: the engine loads it once built (``_load_engine_checkpoint``)."""
        check_trainer_checkpoint(resume_from_checkpoint)

    def _load_engine_checkpoint(self, path: str) -> None:
        """The engine's whole training state from a ``checkpoint-N`` folder (collective)."""
        path = check_trainer_checkpoint(path)
        load_path, client_state = self.engine.load_checkpoint(path)
        if load_path is None:  # check_trainer_checkpoint saw 'latest': only a race gets here
            raise ValueError(f"Can't find a valid checkpoint at {path}: the engine found nothing to load")
        saved, now = (client_state or {}).get("train_batch_size"), self.engine.train_batch_size()
        if saved is not None and saved != now:
            warnings.warn(
                f"ZeroTrainer: {path} was saved with a global batch of {saved} samples per step, this "
                f"run has {now} (per-device batch x gradient accumulation x ranks): the run goes on "
                "from the saved state, but the skipped batches and the steps after do not match the "
                "saved run's",
                stacklevel=2,
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Nothing apart: the engine's checkpoint holds both and loads with the weights."""

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Nothing apart: the engine's loss scaler loads with its checkpoint."""

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """This process's generators as they were at the save, when the world size is the same."""
        if checkpoint is None:
            return
        why = rng.load_rank_file(checkpoint, RNG_FILE, self.args.process_index, self.args.world_size)
        if why is not None:
            logger.info(
                "random generators not restored (%s): random layers such as dropout draw other "
                "numbers than the saved run would have",
                why,
            )

    def _load_best_model(self) -> None:
        """The best checkpoint's engine state, as the Trainer's DeepSpeed path loads it."""
        best = self.state.best_model_checkpoint
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        self._load_engine_checkpoint(best)
