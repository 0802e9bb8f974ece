"""Loading engine checkpoints of zero-pipe's format 2 (written before universal checkpoints).

[Note: format-2 pipeline checkpoints]
Until universal pipeline checkpoints (see [Note: universal pipeline checkpoints] in
``checkpoint.py``), ``PipelineEngine.save_checkpoint`` wrote a tag holding the layer files of
[Note: per-layer pipeline checkpoints], one ``optim_states-pp_<stage>-dp_<dp>.{safetensors,json}``
pair per rank (the ZeRO strategy's ``state_dict``, scheduler, loss scaler, counters and client
state, see [Note: state files without pickle] in ``state_io.py``), and ``pipe_layers.json``
with an ``"engine"`` section. Such a tag still loads, as it did then: the weights at any number
of stages (they are per layer), the scheduler, counters and client state in any layout (from
stage 0, replica 0's file), and the optimizer states only into the layout they were saved with
(same stages, chunks, stage boundaries, data-parallel size and ZeRO stage: they are the
strategy's flat per-rank state, which has no parameter names to reshard by). Saving again
writes the universal format, which loads in any layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.metadata import check_int, check_loss_scaler

from zero_pipe.layer_files import load_layers
from zero_pipe.state_io import load_state

if TYPE_CHECKING:
    from zero_pipe.engine import PipelineEngine


def _rank_stem(stage: int, dp: int) -> str:
    return f"optim_states-pp_{stage:02d}-dp_{dp:02d}"


def _check_counters(state: dict[str, Any], where: str) -> None:
    for k in ("global_steps", "global_samples", "skipped_steps"):
        check_int(state, k, where)
    if state["skipped_steps"] > state["global_steps"]:
        raise CheckpointError(f"{where}: skipped_steps {state['skipped_steps']} > global_steps (edited?)")


def _check_layout(engine: PipelineEngine, meta: dict[str, Any]) -> None:
    """Format-2 optimizer states load only into the layout they were saved with."""
    mine = (engine.num_stages, engine.num_chunks, engine.dp_size, int(engine.config.zero_optimization.stage))
    saved = (meta["num_stages"], meta["num_chunks"], meta["data_parallel_size"], meta["zero_stage"])
    if mine != saved:
        raise ValueError(
            f"load_checkpoint: this is a format-2 zero-pipe checkpoint (from before universal checkpoints); "
            f"its optimizer states were saved with (stages, chunks, dp, zero stage) = {saved}, this engine "
            f"has {mine}. Load it in that layout and save again (the new format loads in any layout), or "
            "load with load_optimizer_states=False to take only the model, scheduler and counters"
        )
    if "parts" in meta and list(meta["parts"]) != list(engine.module.parts):
        raise ValueError(
            f"load_checkpoint: this format-2 checkpoint's optimizer states were saved with stage boundaries "
            f"{meta['parts']}, this module has {list(engine.module.parts)} (another partition_method?); load "
            "with load_optimizer_states=False to take only the model, or in the saved layout and save again"
        )


def load_format2_checkpoint(
    engine: PipelineEngine,
    ckpt_dir: str,
    meta: dict[str, Any],
    *,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[str, dict]:
    """Load a format-2 tag (root record ``meta``, verified); see [Note: format-2 pipeline checkpoints]."""
    saved = meta.get("engine")
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{ckpt_dir} holds module layers only (save_state_dict), not an engine checkpoint; load it with "
            "module.load_state_dir()"
        )
    if load_optimizer_states and not load_module_only:
        _check_layout(engine, saved)  # before anything is overwritten
    load_layers(engine.module, ckpt_dir, meta, load_module_strict)
    if load_module_only:
        engine.stage_optimizer.refresh_masters_from_module()
        return ckpt_dir, {}
    grid = engine.grid
    if load_optimizer_states:
        state = load_state(ckpt_dir, meta, _rank_stem(grid.stage_id, grid.data_parallel_id))
        check_loss_scaler(state["loss_scaler"], ckpt_dir)
        _check_counters(state, ckpt_dir)
        engine.strategy.load_state_dict(state["strategy"])
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
        if not engine.config.zero_optimization.load_from_fp32_weights:
            engine.stage_optimizer.refresh_masters_from_module()  # DeepSpeed's masters from the 16-bit weights
    else:
        # Scheduler, counters and client state are the same on every rank: take (stage 0, replica 0)'s.
        state = load_state(ckpt_dir, meta, _rank_stem(0, 0), skip=("strategy", "loss_scaler"))
        _check_counters(state, ckpt_dir)
        engine.stage_optimizer.refresh_masters_from_module()
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.stage_optimizer.skipped_steps = int(state["skipped_steps"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    return ckpt_dir, state["client_state"]
