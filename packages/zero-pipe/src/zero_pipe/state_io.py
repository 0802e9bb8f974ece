"""Reading nested state (optimizer/scheduler state dicts) from one safetensors file plus one JSON file.

Only format-2 pipeline checkpoints hold such files (see [Note: format-2 pipeline checkpoints]
in ``legacy_checkpoint.py``); the engine now saves through zero-core's fragments.

[Note: state files without pickle]
A state dict was a tree of dicts, lists, tuples, numbers, strings, None and tensors. The tensors
go into ``<stem>.safetensors`` under generated keys; the tree goes into ``<stem>.json`` with each
tensor replaced by ``{"__tensor__": key}``, each tuple by ``{"__tuple__": [...]}`` and each dict
by ``{"__dict__": [[key, value], ...]}`` (so integer keys, as in optimizer states, survive).
Both files were written by zero-core's checkpoint writer (atomic, checksummed; see [Note: one
checkpoint writer] in ``zero_core/checkpoint/staged.py``) and are verified against the tag's
record before they are read.
"""

from __future__ import annotations

from typing import Any

import torch
from zero_core.checkpoint.staged import checked_path, read_json_file
from zero_core.checkpoint.tensor_file import TensorFile


class _OpenTensors:
    """The tensors of an open, verified tensor file, read one key at a time (only those looked up)."""

    def __init__(self, f: TensorFile) -> None:
        self.f = f

    def __contains__(self, key: str) -> bool:
        return key in self.f.keys()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.f.read_tensor(key)


def _decode(obj: Any, tensors: _OpenTensors, where: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, where) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            if obj["__tensor__"] not in tensors:
                raise ValueError(
                    f"load_state: {where} names tensor {obj['__tensor__']!r}, which its file lacks"
                )
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors, where) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in obj["__dict__"]}
        raise ValueError(f"load_state: {where} has an unexpected JSON object with keys {sorted(obj)}")
    return obj


def load_state(tag_dir: str, meta: dict[str, Any], stem: str, skip: tuple[str, ...] = ()) -> Any:
    """Read what :func:`save_state` wrote into the tag at ``tag_dir`` (root record ``meta``), verified.

    ``skip`` names top-level keys of a dict state to leave out, e.g. another rank's optimizer
    state when only its scheduler and counters are wanted.
    """
    doc = read_json_file(tag_dir, meta, stem + ".json")
    where = f"{tag_dir}/{stem}.json"
    if not isinstance(doc, dict) or doc.get("format_version") != 1:
        raise ValueError(f"load_state: {where} has unknown format_version {doc.get('format_version')!r}")
    tree = doc["tree"]
    if skip:
        if not (isinstance(tree, dict) and "__dict__" in tree):
            raise ValueError(f"load_state: skip={skip!r} needs a dict state, {where} holds another")
        tree = {"__dict__": [kv for kv in tree["__dict__"] if kv[0] not in skip]}
    with TensorFile(checked_path(tag_dir, meta, stem + ".safetensors")) as f:
        return _decode(tree, _OpenTensors(f), where)
