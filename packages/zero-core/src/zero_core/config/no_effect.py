"""Config keys that cannot change what a run computes here: accepted, and set they warn once.

DeepSpeed configs carry tuning knobs of DeepSpeed's own implementation (which fused optimizer
wrapper, whether ranks load a checkpoint one after the other, ...) that have no counterpart in
zero and cannot change the numbers a run produces. Rejecting them would stop such configs from
running; ignoring them silently would break the rule that a key we accept either works or says
loudly that it does nothing (See [Note: config key truth] in ``key_paths.py``). Each is listed
in :data:`NO_EFFECT` with why; a value other than the model's default warns once per process
(a forked child starts afresh), naming the key.
"""

from __future__ import annotations

import os
import threading
import warnings

from zero_core.config.key_paths import is_set
from zero_core.config.root import ZeroConfig

#: dotted key -> why it has no effect here. One entry per line.
NO_EFFECT: dict[str, str] = {
    "seq_parallel_communication_data_type": (
        "it is the dtype of sequence-parallel collectives, and zero has no sequence parallelism "
        "(sequence_parallel_size > 1 is an error)"
    ),
    "zero_allow_untested_optimizer": (
        "zero wraps any torch.optim.Optimizer at every ZeRO stage; there is no list of tested optimizers to lift"
    ),
    "zero_force_ds_cpu_optimizer": (
        "with offload_optimizer zero steps Adam/AdamW with its own CPU Adam kernel, which computes torch's "
        "Adam; any other optimizer cannot be offloaded, whatever this key says"
    ),
    "disable_allgather": "DeepSpeed parses it and reads it nowhere; zero neither",
    "graph_harvesting": (
        "DeepSpeed's accelerator graph capture (removed in DeepSpeed 0.19) only changes speed; zero has none"
    ),
    "optimizer.legacy_fusion": (
        "it picks between DeepSpeed's fused and unfused fp16 optimizer wrappers, which compute the same "
        "update; zero has one"
    ),
    "bf16.immediate_grad_update": (
        "it picks when DeepSpeed's bf16 optimizer adds each gradient to its fp32 accumulator (from the "
        "backward hook or after backward), with the same sums; zero adds them from the hook whenever "
        "data_types.grad_accum_dtype asks for a wider dtype"
    ),
    "zero_optimization.elastic_checkpoint": (
        "zero's checkpoints always load at any world size and ZeRO stage (they hold named fragments, "
        "see [Note: checkpoint format])"
    ),
    "zero_optimization.memory_efficient_linear": (
        "DeepSpeed's stage 3 swaps torch.nn.functional.linear for a version that keeps less for backward, "
        "which changes memory, not results; zero does not replace torch.nn.functional.linear"
    ),
    "zero_optimization.pipeline_loading_checkpoint": (
        "DeepSpeed loads stage-3 checkpoints one local rank after another to bound host memory; zero's "
        "ranks read their own fragments straight into place, with the same result"
    ),
    "zero_optimization.override_module_apply": (
        "zero.Init gathers a partitioned parameter whenever it is touched inside the context, so "
        "Module.apply sees whole parameters whether or not apply itself is wrapped"
    ),
    "zero_optimization.log_trace_cache_warnings": (
        "a logging switch of DeepSpeed's stage-3 prefetch trace, which zero does not have"
    ),
    "zero_optimization.round_robin_gradients": (
        "every reduce bucket is already split evenly over the ranks, so there is nothing to rotate "
        "(see [Note: round_robin_gradients] in zero/stage_1_and_2.py)"
    ),
    "checkpoint.load_universal": (
        "every zero checkpoint is universal: load_checkpoint reshards it to the current world size and "
        "ZeRO stage; there is no separate format to convert to (DeepSpeed's ds_to_universal output is not read)"
    ),
    "checkpoint.parallel_write.pipeline_stage": (
        "zero-pipe's data-parallel replica 0 of every stage writes that stage's layer files; spreading "
        "them over the replicas would write the same files"
    ),
    "pipeline.partition": (
        "DeepSpeed reads the partition method from PipelineModule(partition_method=...), not from the "
        "config; so does zero"
    ),
    "pipeline.seed_layers": (
        "DeepSpeed reads it from PipelineModule(seed_layers=...), not from the config; so does zero"
    ),
    "pipeline.pipe_partitioned": (
        "it splits the activations sent between stages over tensor-parallel ranks, and zero trains "
        "without tensor parallelism"
    ),
    "pipeline.grad_partitioned": (
        "it splits the gradients sent between stages over tensor-parallel ranks, and zero trains "
        "without tensor parallelism"
    ),
    "moe.enable_expert_tensor_parallelism": (
        "zero has no tensor model parallelism to split experts over; experts stay whole on their "
        "expert-parallel rank"
    ),
    "aio.intra_op_parallelism": (
        "zero's asynchronous I/O handle spreads requests over aio.thread_count threads and has no "
        "second level of parallelism"
    ),
    "aio.use_gds": (
        "GPUDirect Storage only changes the path of NVMe reads and writes; zero's NVMe offload goes "
        "through pinned host buffers, with the same data"
    ),
    "timers.throughput.synchronized": (
        "zero measures samples/s from the wall-clock time between optimizer steps and never adds a "
        "device synchronize for it (that would cost a host sync per step)"
    ),
}

_lock = threading.Lock()
_warned: set[str] = set()


def reset_no_effect_warnings() -> None:
    """Forget which keys warned (each warns once per process; tests call this)."""
    with _lock:
        _warned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=reset_no_effect_warnings)


def warn_no_effect(key: str, stacklevel: int = 3) -> None:
    """Warn, once per process, that ``key`` (of :data:`NO_EFFECT`) is set and does nothing here."""
    if key not in NO_EFFECT:
        raise KeyError(f"warn_no_effect: {key!r} is not a key of NO_EFFECT")
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(
        f"{key} is set but has no effect in zero: {NO_EFFECT[key]}", UserWarning, stacklevel=stacklevel
    )


def check_no_effect(cfg: ZeroConfig) -> None:
    """Warn for every key of :data:`NO_EFFECT` that the validated ``cfg`` sets to a non-default value."""
    for key in NO_EFFECT:
        if is_set(cfg, key)[0]:
            warn_no_effect(key, stacklevel=4)
