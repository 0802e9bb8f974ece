"""Atomic safetensors writes of a full (gathered) model state dict, for ``save_16bit_model``."""

from __future__ import annotations

import os
import tempfile

import torch


def write_state_dict(state: dict[str, torch.Tensor], path: str) -> None:
    """Write ``state`` to ``path`` as safetensors: temp file, fsync, rename (never a torn file)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"write_state_dict: path must be a str or os.PathLike, got {type(path).__name__}")
    from safetensors.torch import save_file

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # safetensors refuses tensors that share memory: give each key its own contiguous copy.
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
