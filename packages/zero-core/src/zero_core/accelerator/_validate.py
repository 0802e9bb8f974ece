"""Argument checks shared by the accelerator implementations."""

from __future__ import annotations

import torch


def check_index(index: object, where: str) -> None:
    """``index`` must be None or a non-negative int (bool is rejected)."""
    if index is None:
        return
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{where}: device index must be a non-negative int or None, got {index!r}")


def check_tensor(tensor: object, where: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")


def check_seed(seed: object, where: str) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{where}: seed must be an int, got {type(seed).__name__}")


def check_rng_state(state: object, where: str) -> None:
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise TypeError(f"{where}: RNG state must be a uint8 torch.Tensor as returned by get_rng_state()")
