"""Nested state (optimizer/scheduler state dicts) as one safetensors file plus one JSON file.

[Note: state files without pickle]
A state dict is a tree of dicts, lists, tuples, numbers, strings, None and tensors. The tensors
go into ``<stem>.safetensors`` under generated keys; the tree goes into ``<stem>.json`` with each
tensor replaced by ``{"__tensor__": key}``, each tuple by ``{"__tuple__": [...]}`` and each dict
by ``{"__dict__": [[key, value], ...]}`` (so integer keys, as in optimizer states, survive).
Anything else (a function in a LambdaLR, an arbitrary object) is an error naming its path.
Every file is written to a temporary name, fsynced and renamed into place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_SCALARS = (bool, int, float, str, type(None))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write ``tensors`` to ``path`` atomically (tmp + fsync + rename)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(tmp))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(obj: Any, path: str | os.PathLike) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (tmp + fsync + rename)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, dict):
        return {
            "__dict__": [
                [_encode(k, tensors, where), _encode(v, tensors, f"{where}.{k}")] for k, v in obj.items()
            ]
        }
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(
        f"state at {where} is a {type(obj).__name__}, which cannot be saved without pickle; "
        "checkpoints hold tensors, numbers, strings, None, and dicts/lists/tuples of them"
    )


class _OpenTensors:
    """The tensors of an open safetensors file, read one key at a time (only those looked up)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.fh.get_tensor(key)


def _decode(obj: Any, tensors: _OpenTensors) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}
        raise ValueError(f"state file: unexpected JSON object with keys {sorted(obj)}")
    return obj


def save_state(state: Any, stem: str | os.PathLike) -> None:
    """Write ``state`` as ``<stem>.safetensors`` + ``<stem>.json``. See [Note: state files without pickle]."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, "state")
    stem = str(stem)
    atomic_write_safetensors(tensors, stem + ".safetensors")
    atomic_write_json({"format_version": 1, "tree": tree}, stem + ".json")


def load_state(
    stem: str | os.PathLike, device: str | torch.device = "cpu", skip: tuple[str, ...] = ()
) -> Any:
    """Read what :func:`save_state` wrote. ``skip`` names top-level keys of a dict state to leave
    out (their tensors are not read), e.g. another rank's optimizer state when only its
    scheduler and counters are wanted."""
    stem = str(stem)
    for suffix in (".json", ".safetensors"):
        if not os.path.isfile(stem + suffix):
            raise FileNotFoundError(f"load_state: missing checkpoint file {stem + suffix}")
    with open(stem + ".json") as fh:
        doc = json.load(fh)
    if doc.get("format_version") != 1:
        raise ValueError(f"load_state: {stem}.json has unknown format_version {doc.get('format_version')!r}")
    tree = doc["tree"]
    if skip:
        if not (isinstance(tree, dict) and "__dict__" in tree):
            raise ValueError(f"load_state: skip={skip!r} needs a dict state, {stem}.json holds another")
        tree = {"__dict__": [kv for kv in tree["__dict__"] if kv[0] not in skip]}
    with safe_open(stem + ".safetensors", framework="pt", device=str(device)) as fh:
        return _decode(tree, _OpenTensors(fh))
