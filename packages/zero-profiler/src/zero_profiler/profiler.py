"""``FlopsProfiler`` and ``get_model_profile``: DeepSpeed's flops profiler API on exact counting.

Counting itself is in :mod:`zero_profiler.tracking` (see [Note: attribution by executed
operator]); the FLOP conventions are in :mod:`zero_profiler.flop_formulas` (see [Note: FLOP
conventions]). This module holds the user-facing lifecycle:
``start_profile -> (model runs) -> stop_profile -> get_*/print_* -> end_profile``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from zero_profiler import report
from zero_profiler.tracking import ModuleStats, ModuleTracker
from zero_profiler.units import duration_to_string, flops_to_string, macs_to_string, params_to_string

_MODES = ("forward", "train", "generate")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically: temporary file in the same folder, fsync, rename.

    zero-profiler's own writer, as it depends on torch alone: see [Note: one atomic writer] in
    zero-core's ``checkpoint/atomic.py``, the writer of the rest of the family."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".txt")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_depth(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"module_depth must be -1 (every depth) or an int >= 0, got {value!r}")


def _ignore_types(ignore_list: Sequence[type] | None, where: str) -> tuple[type, ...]:
    if ignore_list is None:
        return ()
    if isinstance(ignore_list, type) or not isinstance(ignore_list, (list, tuple, set)):
        raise TypeError(f"{where} must be a list of torch.nn.Module subclasses, got {ignore_list!r}")
    bad = [t for t in ignore_list if not (isinstance(t, type) and issubclass(t, torch.nn.Module))]
    if bad:
        raise TypeError(f"{where} must hold torch.nn.Module subclasses; not module classes: {bad!r}")
    return tuple(ignore_list)


class FlopsProfiler:
    """Measures latency, FLOPs, MACs and parameters of each module of a PyTorch model.

    Args:
        model: the module to profile.
        ds_engine: optional training engine. When given, the profile header reports its
            world/data/model-parallel sizes and micro-batch size, and backward operators are
            counted (the engine runs backward between ``start_profile`` and ``stop_profile``).
            Duck-typed: ``world_size``, ``dp_world_size``, ``mp_world_size``,
            ``train_micro_batch_size_per_gpu()`` are used when present.
        recompute_fwd_factor: fraction of the forward recomputed in backward by activation
            checkpointing, used for the fwd+bwd estimate when no recomputation was observed.
        fast_path: count known torch functions at function level and the rest at ATen level
            (default; the same counts at a fraction of the cost). ``False`` counts every ATen
            operator with a dispatch mode, which also sees operators run by C++ extensions
            outside torch functions. See [Note: function-level fast path] in
            :mod:`zero_profiler.function_mode`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ds_engine: torch.nn.Module | None = None,
        recompute_fwd_factor: float = 0.0,
        *,
        fast_path: bool = True,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"FlopsProfiler: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(fast_path, bool):
            raise TypeError(f"FlopsProfiler: fast_path must be True or False, got {fast_path!r}")
        if isinstance(recompute_fwd_factor, bool) or not isinstance(recompute_fwd_factor, (int, float)):
            raise TypeError(
                f"FlopsProfiler: recompute_fwd_factor must be a number, got {recompute_fwd_factor!r}"
            )
        if not 0.0 <= float(recompute_fwd_factor) <= 1.0:
            raise ValueError(
                f"FlopsProfiler: recompute_fwd_factor must be in [0, 1], got {recompute_fwd_factor}"
            )
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.track_backward = ds_engine is not None
        self.fast_path = fast_path
        self.step_latency: float | None = None  # set by callers that time the optimizer step
        self._tracker: ModuleTracker | None = None
        self.started = False
        # DeepSpeed's attributes: forward FLOPs, MACs and parameters of the last printed profile
        # (the engine's profile step reads them as ``engine.flops_profiler.flops``)
        self.flops: int | None = None
        self.macs: int | None = None
        self.params: int | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start profiling: bracket every module call and start counting executed operators.

        ``ignore_list``: module classes whose work is not counted at all: neither their forward
        nor (when backward is tracked) their backward, in their own profile, their parents' or
        the totals.
        """
        ignore = _ignore_types(ignore_list, "start_profile: ignore_list")
        if self.started:
            raise RuntimeError("start_profile: profiling already started; call end_profile() first")
        self._tracker = ModuleTracker(
            self.model, ignore, track_backward=self.track_backward, fast_path=self.fast_path
        )
        self._tracker.attach()
        self._tracker.start_counting()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting and timing; the measured profile stays readable until ``end_profile``."""
        if self._tracker is not None:
            self._tracker.stop_counting()
            self._tracker.detach()

    def reset_profile(self) -> None:
        """Zero every counter (profiling goes on)."""
        if self._tracker is not None:
            self._tracker.reset()

    def end_profile(self) -> None:
        """End profiling: stop, restore every module's forward and drop the measured profile."""
        self.stop_profile()
        self._tracker = None
        self.started = False

    # -- results ----------------------------------------------------------------------------------

    def _require(self, what: str) -> ModuleTracker:
        if self._tracker is None:
            raise RuntimeError(f"{what}: no profile; call start_profile() and run the model first")
        return self._tracker

    def module_stats(self, module: torch.nn.Module) -> ModuleStats:
        """The counters of one submodule (inclusive of its children)."""
        tracker = self._require("module_stats")
        if module not in tracker.stats:
            raise KeyError("module_stats: module is not part of the profiled model")
        return tracker.stats[module]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of the model's forward pass(es) since the profile started or was reset."""
        flops = self._require("get_total_flops").totals.fwd_flops
        return flops_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulate operations of the model's forward pass(es)."""
        macs = self._require("get_total_macs").totals.fwd_macs
        return macs_to_string(macs) if as_string else macs

    def get_total_backward_flops(self, as_string: bool = False) -> int | str:
        """FLOPs measured in the model's backward pass (0 unless backward ran while counting)."""
        flops = self._require("get_total_backward_flops").totals.bwd_flops
        return flops_to_string(flops) if as_string else flops

    def get_total_recompute_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of forward work replayed during backward (activation checkpointing)."""
        flops = self._require("get_total_recompute_flops").totals.recompute_flops
        return flops_to_string(flops) if as_string else flops

    def get_flops_by_op(self) -> dict[Any, int]:
        """FLOPs per ATen operator (overload packet, e.g. ``torch.ops.aten.mm``), every phase."""
        return dict(self._require("get_flops_by_op").totals.by_op)

    def backward_measured(self) -> bool:
        totals = self._require("backward_measured").totals
        return totals.bwd_first_op is not None and totals.bwd_flops > 0

    def get_total_train_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of forward + backward (+ recomputation).

        Measured when backward ran while counting; otherwise the usual estimate
        ``(3 + recompute_fwd_factor) * forward``. Observed recomputation is used when there was
        some, else ``recompute_fwd_factor * forward`` is added.
        """
        t = self._require("get_total_train_flops").totals
        if self.backward_measured():
            recompute = (
                t.recompute_flops if t.recompute_flops else round(self.recompute_fwd_factor * t.fwd_flops)
            )
            flops = t.fwd_flops + t.bwd_flops + recompute
        else:
            flops = round((3 + self.recompute_fwd_factor) * t.fwd_flops)
        return flops_to_string(flops) if as_string else flops

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Latency of the model's forward pass(es), in seconds."""
        tracker = self._require("get_total_duration")
        duration = report.effective_stats(self.model, tracker.stats)[self.model].fwd_duration
        return duration_to_string(duration) if as_string else duration

    def get_total_backward_duration(self) -> float | None:
        """Seconds from the first to the last backward operator seen (None when none ran)."""
        t = self._require("get_total_backward_duration").totals
        if t.bwd_first_op is None or t.bwd_last_op is None:
            return None
        return t.bwd_last_op - t.bwd_first_op

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model, shared parameters counted once.

        A ZeRO-3 partitioned parameter counts its full size (``zero_numel``/``ds_numel``).
        """
        params = report.count_params(self.model)
        return params_to_string(params) if as_string else params

    # -- printing ---------------------------------------------------------------------------------

    def _summary(self, profile_step: int) -> report.Summary:
        tracker = self._require("print_model_profile")
        engine = self.ds_engine
        world = int(getattr(engine, "world_size", 1) or 1)
        dp = int(getattr(engine, "dp_world_size", world) or 1)
        mp = int(getattr(engine, "mp_world_size", 1) or 1)
        batch = None
        if engine is not None and callable(getattr(engine, "train_micro_batch_size_per_gpu", None)):
            batch = int(engine.train_micro_batch_size_per_gpu())
        measured = self.backward_measured()
        return report.Summary(
            step=profile_step,
            world_size=world,
            dp_size=dp,
            mp_size=mp,
            batch_size=batch,
            params=report.count_params(self.model),
            fwd_flops=tracker.totals.fwd_flops,
            fwd_macs=tracker.totals.fwd_macs,
            bwd_flops=tracker.totals.bwd_flops if measured else None,
            train_flops=int(self.get_total_train_flops()),
            fwd_latency=report.effective_stats(self.model, tracker.stats)[self.model].fwd_duration,
            bwd_latency=self.get_total_backward_duration() if measured else None,
            step_latency=self.step_latency,
        )

    def model_profile_text(
        self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1, detailed: bool = True
    ) -> str:
        """The text ``print_model_profile`` prints."""
        _check_int("profile_step", profile_step, 0)
        _check_depth(module_depth)
        _check_int("top_modules", top_modules, 1)
        tracker = self._require("print_model_profile")
        self.flops = int(self.get_total_flops())
        self.macs = int(self.get_total_macs())
        self.params = int(self.get_total_params())
        parts = [
            report.summary_text(self._summary(profile_step)),
            report.aggregated_text(self.model, tracker.stats, module_depth, top_modules),
        ]
        if detailed:
            parts.append(
                report.detailed_text(self.model, tracker.stats, module_depth, self.backward_measured())
            )
        return "\n".join(parts) + "\n"

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | os.PathLike | None = None,
    ) -> None:
        """Print the summary, the top modules per depth and (``detailed``) the annotated module tree.

        ``output_file``: path to write the profile to instead of stdout (written atomically).
        """
        text = self.model_profile_text(profile_step, module_depth, top_modules, detailed)
        if output_file is None:
            sys.stdout.write(text)
        else:
            write_text_atomic(output_file, text)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the ``top_modules`` module classes by params, MACs and latency at each depth."""
        _check_depth(module_depth)
        _check_int("top_modules", top_modules, 1)
        tracker = self._require("print_model_aggregated_profile")
        sys.stdout.write(report.aggregated_text(self.model, tracker.stats, module_depth, top_modules) + "\n")


def _run(model: torch.nn.Module, args: Sequence[Any], kwargs: dict, mode: str) -> Any:
    if mode == "generate":
        if not callable(getattr(model, "generate", None)):
            raise TypeError("get_model_profile: mode='generate' needs a model with a generate() method")
        return model.generate(*args, **kwargs)
    return model(*args, **kwargs)


def _backward(output: object) -> None:
    """Backpropagate from every floating output tensor that requires grad (ones as upstream grad)."""
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise RuntimeError("get_model_profile: mode='train' needs a model output that requires grad")
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def _check_profile_arguments(
    model: object,
    mode: object,
    args: object,
    kwargs: object,
    warm_up: object,
    module_depth: object,
    top_modules: object,
) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in _MODES:
        raise ValueError(f"get_model_profile: mode must be one of {_MODES}, got {mode!r}")
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"get_model_profile: args must be a list or tuple, got {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise TypeError(f"get_model_profile: kwargs must be a dict, got {type(kwargs).__name__}")
    _check_int("warm_up", warm_up, 0)
    _check_depth(module_depth)
    _check_int("top_modules", top_modules, 1)


def _model_inputs(
    model: torch.nn.Module, input_shape: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> Sequence[Any]:
    """The positional inputs: ``args``, or with ``input_shape`` one tensor of ones of that shape
    (dtype and device of the model's first parameter)."""
    if input_shape is None:
        if not args and not kwargs:
            raise ValueError("get_model_profile: give input_shape, or the model's inputs as args/kwargs")
        return args
    if (
        not isinstance(input_shape, (tuple, list))
        or not input_shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in input_shape)
    ):
        raise ValueError(
            f"get_model_profile: input_shape must be a non-empty tuple of positive ints, got {input_shape!r}"
        )
    if args:
        raise ValueError("get_model_profile: give either input_shape or args, not both")
    first = next(model.parameters(), None)
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.get_default_dtype()
    device = first.device if first is not None else torch.device("cpu")
    return [torch.ones(tuple(input_shape), dtype=dtype, device=device)]


def _profile_run(
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    mode: str,
    warm_up: int,
    ignore_modules: Sequence[type] | None,
) -> FlopsProfiler:
    """``warm_up`` unprofiled runs, then one profiled run (with its backward in ``'train'`` mode)."""
    grad = torch.enable_grad() if mode == "train" else torch.no_grad()
    with grad:
        for _ in range(warm_up):
            _run(model, args, kwargs, mode)
        prof = FlopsProfiler(model)
        prof.track_backward = mode == "train"
        prof.start_profile(ignore_list=ignore_modules)
        try:
            output = _run(model, args, kwargs, mode)
            if mode == "train":
                _backward(output)
        finally:
            prof.stop_profile()
    return prof


def get_model_profile(
    model: torch.nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = [],  # noqa: B006 (DeepSpeed's signature; never mutated)
    kwargs: dict[str, Any] = {},  # noqa: B006
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | os.PathLike | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[int | str, int | str, int | str]:
    """Profile one run of ``model`` and return ``(flops, macs, params)``.

    ``mode``: ``'forward'`` (one forward pass, under ``torch.no_grad``), ``'generate'``
    (``model.generate(*args, **kwargs)``), or ``'train'`` (forward, then backward from every
    output that requires grad with an all-ones upstream gradient; flops and MACs returned are
    then forward + backward (+ recomputation), all measured).
    ``input_shape``: when given, the model is called with one tensor of ones of that shape
    (dtype and device of the model's first parameter) as its only positional argument.
    """
    _check_profile_arguments(model, mode, args, kwargs, warm_up, module_depth, top_modules)
    args = _model_inputs(model, input_shape, args, kwargs)
    # A training-mode profile must not leave its gradients in the user's parameters.
    saved_grads = {p: p.grad for p in model.parameters()} if mode == "train" else {}
    prof = _profile_run(model, args, kwargs, mode, warm_up, ignore_modules)
    totals = prof._require("get_model_profile").totals
    if mode == "train":
        flops = totals.fwd_flops + totals.bwd_flops + totals.recompute_flops
        macs = totals.fwd_macs + totals.bwd_macs + totals.recompute_macs
    else:
        flops, macs = totals.fwd_flops, totals.fwd_macs
    params = prof.get_total_params()
    if print_profile:
        prof.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    prof.end_profile()
    for p, g in saved_grads.items():
        p.grad = g
    if as_string:
        return flops_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
