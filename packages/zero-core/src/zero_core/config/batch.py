"""Batch-size derivation: ``train_batch_size = micro_batch * gradient_accumulation_steps * dp_world``.

As in DeepSpeed, any two of the three sizes derive the third from the data-parallel world size;
with only one given, ``gradient_accumulation_steps`` defaults to 1; with all three given they must
agree. The error for an inconsistent triple shows the three values, the world size and where that
world size came from, because a wrong world size (a launcher variable left over in the
environment, a pipeline/tensor-parallel degree not divided out) is the usual cause.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from zero_core.config.errors import ConfigError

#: environment variables naming the world size, in the order they are trusted, with their source.
WORLD_SIZE_VARIABLES = (
    ("WORLD_SIZE", "torchrun env (WORLD_SIZE)"),
    ("OMPI_COMM_WORLD_SIZE", "MPI (OMPI_COMM_WORLD_SIZE)"),
    ("PMI_SIZE", "MPI (PMI_SIZE)"),
    ("SLURM_NTASKS", "Slurm (SLURM_NTASKS)"),
)
DEFAULT_SOURCE = "default (single process)"


@dataclass(frozen=True)
class BatchSizes:
    """The resolved triple and the data-parallel world size it was resolved for."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int
    world_size_source: str


def detect_world_size() -> tuple[int, str]:
    """The world size and where it came from.

    An initialised ``torch.distributed`` process group wins; then the launcher environment
    variables in :data:`WORLD_SIZE_VARIABLES` order; otherwise 1, ``"default (single process)"``.
    """
    dist = sys.modules.get("torch.distributed")  # never import torch just to look
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "torch.distributed (initialized process group)"
    for var, source in WORLD_SIZE_VARIABLES:
        raw = os.environ.get(var)
        if raw is None or raw.strip() == "":
            continue
        try:
            size = int(raw)
        except ValueError:
            raise ConfigError([f"environment variable {var}={raw!r} is not an integer world size"]) from None
        if size < 1:
            raise ConfigError([f"environment variable {var}={raw!r}: world size must be >= 1"])
        return size, source
    return 1, DEFAULT_SOURCE


def _check_size(name: str, value: object) -> int | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError([f"{name}: {value!r} is not an integer"])
    if value < 1:
        raise ConfigError([f"{name}: {value} is out of range: must be >= 1"])
    return value


def auto_batch_hint(names: list[str]) -> str:
    """The explanation appended to a batch-size error when the sizes ``names`` were ``"auto"``."""
    if not names:
        return ""
    return (
        f'; {" and ".join(names)} {"is" if len(names) == 1 else "are"} "auto", which the HuggingFace '
        "Trainer replaces with its own batch size before it hands the config over: without the Trainer, "
        "write the number"
    )


def resolve_batch_size(
    train_batch_size: int | None = None,
    train_micro_batch_size_per_gpu: int | None = None,
    gradient_accumulation_steps: int | None = None,
    *,
    world_size: int | None = None,
    world_size_source: str | None = None,
    auto_names: tuple[str, ...] = (),
) -> BatchSizes:
    """Complete the batch-size triple for a data-parallel world of ``world_size`` ranks.

    ``None`` (or ``"auto"``) marks a size to derive; ``auto_names`` names sizes that were
    ``"auto"`` before they reached here as None (a validated config), for the error message. ``world_size`` is the *data-parallel* size
    (world / (pipeline * tensor parallel degree)); when omitted it is detected with
    :func:`detect_world_size`. ``world_size_source`` says where the caller got it
    (``"explicit"`` when omitted with an explicit ``world_size``). Raises :class:`ConfigError`.
    """
    train = _check_size("train_batch_size", train_batch_size)
    micro = _check_size("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu)
    gas = _check_size("gradient_accumulation_steps", gradient_accumulation_steps)
    if world_size is None:
        world_size, detected = detect_world_size()
        world_size_source = world_size_source or detected
    else:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError([f"world_size: {world_size!r} must be an integer >= 1"])
        world_size_source = world_size_source or "explicit"

    def inconsistent(reason: str) -> ConfigError:
        def show(v: int | None) -> str:
            return "not given" if v is None else str(v)

        return ConfigError(
            [
                f"batch sizes are inconsistent: {reason}: train_batch_size={show(train)}, "
                f"train_micro_batch_size_per_gpu={show(micro)}, gradient_accumulation_steps={show(gas)}, "
                f"data-parallel world size={world_size} (from {world_size_source}); "
                "train_batch_size must equal train_micro_batch_size_per_gpu * gradient_accumulation_steps "
                "* world size"
            ]
        )

    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world_size:
            raise inconsistent(f"{micro} * {gas} * {world_size} = {micro * gas * world_size} != {train}")
    elif train is not None and micro is not None:
        if train % (micro * world_size):
            raise inconsistent(f"{train} is not divisible by {micro} * {world_size}")
        gas = train // (micro * world_size)
    elif train is not None and gas is not None:
        if train % (gas * world_size):
            raise inconsistent(f"{train} is not divisible by {gas} * {world_size}")
        micro = train // (gas * world_size)
    elif micro is not None and gas is not None:
        train = micro * gas * world_size
    elif train is not None:
        gas = 1
        if train % world_size:
            raise inconsistent(f"{train} is not divisible by the world size {world_size}")
        micro = train // world_size
    elif micro is not None:
        gas = 1
        train = micro * world_size
    else:
        message = "batch size: give train_batch_size or train_micro_batch_size_per_gpu (or both)"
        if gas is not None:
            message += f"; gradient_accumulation_steps={gas} alone is not enough"
        autos = [
            name
            for name, value in (
                ("train_batch_size", train_batch_size),
                ("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu),
            )
            if value == "auto" or name in auto_names
        ]
        raise ConfigError([message + auto_batch_hint(autos)])
    return BatchSizes(train, micro, gas, world_size, world_size_source)
