"""Atomic safetensors writes of a full (gathered) model state dict, for ``save_16bit_model``.

[Note: 16-bit model files for from_pretrained]
``save_16bit_model(save_dir)`` writes what Hugging Face's ``from_pretrained(save_dir)`` loads:
``model.safetensors``, or past ``max_shard_size`` the shards ``model-00001-of-0000N.safetensors``
... and ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map":
{name: shard}}``), each file with the ``{"format": "pt"}`` metadata transformers checks. We never
write pickle files, so a torch pickle name that DeepSpeed scripts pass (its default
``pytorch_model.bin``; ``.pt``, ``.pth``) gets safetensors under the matching safetensors name
(``pytorch_model.bin`` -> ``model.safetensors``, which ``from_pretrained`` prefers anyway;
``foo.pt`` -> ``foo.safetensors``) with a warning that says so. Files of an earlier save under
the same name (shards, index) are removed, so the directory never mixes two saves.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import torch

from zero_core.checkpoint.atomic import atomic_write_safetensors, atomic_write_text

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
DEFAULT_MAX_SHARD_SIZE = "5GB"


def write_state_dict(state: dict[str, torch.Tensor], path: str) -> None:
    """Write ``state`` to ``path`` as safetensors: temp file, fsync, rename (never a torn file)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"write_state_dict: path must be a str or os.PathLike, got {type(path).__name__}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # safetensors refuses tensors that share memory: give each key its own contiguous copy.
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    atomic_write_safetensors(path, tensors, metadata={"format": "pt"})  # See [Note: one atomic writer]


def safetensors_name(save_filename: str) -> str:
    """The file name written for ``save_filename``. See [Note: 16-bit model files for from_pretrained]."""
    stem, ext = os.path.splitext(save_filename)
    if ext.lower() not in PICKLE_SUFFIXES:
        return save_filename
    new = "model.safetensors" if save_filename == "pytorch_model.bin" else stem + ".safetensors"
    warnings.warn(
        f"save_16bit_model: zero never writes torch pickle files; writing safetensors as {new!r} instead "
        f"of {save_filename!r} (from_pretrained loads it)",
        UserWarning,
        stacklevel=4,
    )
    return new


def _shards(state: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Keys grouped in order into shards of at most ``limit`` bytes (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _remove_stale(directory: str, stem: str, ext: str) -> None:
    pattern = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}" + re.escape(ext) + r"$")
    for name in os.listdir(directory):
        if pattern.match(name) or name == f"{stem}{ext}.index.json" or name == f"{stem}{ext}":
            os.unlink(os.path.join(directory, name))


def write_hf_weights(
    state: dict[str, torch.Tensor],
    save_dir: str,
    save_filename: str = "model.safetensors",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """Write ``state`` as ``from_pretrained`` reads it (one file, or shards and an index past
    ``max_shard_size``); returns the paths written. See [Note: 16-bit model files for from_pretrained]."""
    from zero_core.checkpoint.zero_to_fp32 import parse_size

    limit = parse_size(max_shard_size)
    name = safetensors_name(save_filename)
    os.makedirs(save_dir, exist_ok=True)
    stem, ext = os.path.splitext(name)
    shards = _shards(state, limit)
    _remove_stale(save_dir, stem, ext)
    if len(shards) == 1:
        path = os.path.join(save_dir, name)
        write_state_dict(state, path)
        return [path]
    written, weight_map = [], {}
    for i, keys in enumerate(shards):
        fname = f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}"
        write_state_dict({k: state[k] for k in keys}, os.path.join(save_dir, fname))
        weight_map.update(dict.fromkeys(keys, fname))
        written.append(os.path.join(save_dir, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True
    )
    index_path = os.path.join(save_dir, f"{name}.index.json")
    atomic_write_text(index_path, index)  # last: a reader sees the index only once every shard is there
    return [*written, index_path]
