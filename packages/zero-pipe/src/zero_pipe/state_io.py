"""Nested state (optimizer/scheduler state dicts) as one safetensors file plus one JSON file.

[Note: state files without pickle]
A state dict is a tree of dicts, lists, tuples, numbers, strings, None and tensors. The tensors
go into ``<stem>.safetensors`` under generated keys; the tree goes into ``<stem>.json`` with each
tensor replaced by ``{"__tensor__": key}``, each tuple by ``{"__tuple__": [...]}`` and each dict
by ``{"__dict__": [[key, value], ...]}`` (so integer keys, as in optimizer states, survive).
Anything else (a function in a LambdaLR, an arbitrary object) is an error naming its path.
Both files are written by zero-core's checkpoint writer into the tag being staged (atomic,
checksummed; see [Note: one checkpoint writer] in ``zero_core/checkpoint/staged.py``) and
verified against the tag's record before they are read.
"""

from __future__ import annotations

from typing import Any

import torch
from zero_core.checkpoint.staged import StagedSave, checked_path, read_json_file
from zero_core.checkpoint.tensor_file import TensorFile

_SCALARS = (bool, int, float, str, type(None))


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


def save_state(state: Any, staged: StagedSave, stem: str) -> None:
    """Write ``state`` as ``<stem>.safetensors`` + ``<stem>.json`` into the tag ``staged`` is writing.

    See [Note: state files without pickle].
    """
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, "state")
    staged.write_tensors(stem + ".safetensors", tensors)
    staged.write_json(stem + ".json", {"format_version": 1, "tree": tree})


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
