"""What the flat-buffer optimizer kernels (Adam, Adagrad, Lion) share: validation and ``FlatUpdate``.

The kernels take raw pointers, so every tensor is checked here first: a wrong device, dtype,
size or layout must be a clear Python error, never memory corruption in C++.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch


class FlatUpdate(NamedTuple):
    """One optimizer update of contiguous flat buffers, as the CPU optimizers and the flat kernels
    hand it to an optimizer's update function (see [Note: one update function] in
    zero_ops.flat_kernel). ``hparams`` is a param group or a kernel's merged hyper-parameters;
    ``states`` maps state names (``exp_avg`` ...) to buffers; ``step`` counts from 1."""

    params: torch.Tensor
    grads: torch.Tensor
    states: Mapping[str, torch.Tensor]
    low_precision_out: torch.Tensor | None
    hparams: Mapping[str, Any]
    step: int
    lr: float
    threads: int | None


DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_DTYPE = -1
LOW_PRECISION = (torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.float32, *LOW_PRECISION)


def check_flat(name: str, t: torch.Tensor, numel: int, dtypes: tuple[torch.dtype, ...], where: str) -> None:
    """Raises TypeError/ValueError unless ``t`` is a contiguous CPU tensor of ``numel`` elements."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{where}: {name} must be on the CPU, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{where}: {name} has dtype {t.dtype}; allowed: {allowed}")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError(f"{where}: {name} must be a dense (strided) tensor, got layout {t.layout}")
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous (call .contiguous() on a copy first)")
    if t.numel() != numel:
        raise ValueError(f"{where}: {name} has {t.numel()} elements but params has {numel}")


def check_buffers(
    where: str,
    params_fp32: torch.Tensor,
    grads: torch.Tensor,
    states: Mapping[str, torch.Tensor | None],
    low_precision_out: torch.Tensor | None,
) -> tuple[int, int]:
    """Checks the buffers of one flat update; returns ``(numel, low-precision dtype code)``.

    ``params_fp32`` and the ``states`` (a None state is absent, e.g. AMSGrad's maximum when
    off) must be fp32, ``grads`` fp32/bf16/fp16, ``low_precision_out`` None or bf16/fp16, all
    contiguous CPU tensors of ``params_fp32``'s size that do not overlap in memory.
    """
    if not isinstance(params_fp32, torch.Tensor):
        raise TypeError(f"{where}: params_fp32 must be a torch.Tensor, got {type(params_fp32).__name__}")
    numel = params_fp32.numel()
    check_flat("params_fp32", params_fp32, numel, (torch.float32,), where)
    check_flat("grads", grads, numel, GRAD_DTYPES, where)
    for name, t in states.items():
        if t is not None:
            check_flat(name, t, numel, (torch.float32,), where)
    lp_code = low_precision_code(where, low_precision_out, numel)
    check_distinct(
        where, {"params_fp32": params_fp32, "grads": grads, **states, "low_precision_out": low_precision_out}
    )
    return numel, lp_code


def check_distinct(where: str, tensors: Mapping[str, torch.Tensor | None]) -> None:
    """Raises ValueError if two of the named buffers overlap in memory (the kernels write in place)."""
    spans = []
    for name, t in tensors.items():
        if t is None or t.numel() == 0:
            continue
        start = t.data_ptr()
        spans.append((start, start + t.numel() * t.element_size(), name))
    spans.sort()
    for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"{where}: {n0} and {n1} overlap in memory; each buffer must be separate")
        del s0


def check_scalar(
    where: str,
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Returns ``value`` as float after checking it is finite and inside the given range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be finite, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{where}: {name}={value} must be {'>' if low_open else '>='} {low}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{where}: {name}={value} must be {'<' if high_open else '<='} {high}")
    return value


def check_betas(where: str, betas: object, *, high_open: bool) -> tuple[float, float]:
    """Returns ``betas`` as a float pair after checking both lie in [0, 1] (or [0, 1))."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    beta1, beta2 = (
        check_scalar(where, f"betas[{i}]", b, low=0.0, high=1.0, high_open=high_open)
        for i, b in enumerate(betas)
    )
    return beta1, beta2


def check_step(where: str, step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(
            f"{where}: step must be an int >= 1 (the step count after this update), got {step!r}"
        )
    return step


def resolve_threads(where: str, threads: int | None) -> int:
    """The kernel thread count: ``threads`` if given, else torch's intra-op thread count."""
    if threads is None:
        return max(1, torch.get_num_threads())
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{where}: threads must be an int >= 1 or None, got {threads!r}")
    return threads


def optional_threads(where: str, threads: int | None) -> int | None:
    """A checked explicit thread count, or None to resolve it at each call (see resolve_threads)."""
    return None if threads is None else resolve_threads(where, threads)


def low_precision_code(where: str, out: torch.Tensor | None, numel: int) -> int:
    if out is None:
        return NO_DTYPE
    check_flat("low_precision_out", out, numel, LOW_PRECISION, where)
    return DTYPE_CODES[out.dtype]


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
