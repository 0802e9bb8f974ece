"""Module-only checkpoint directories of zero-pipe and zero-moe, read by ``zero_to_fp32`` and ``inspect``.

[Note: module-only checkpoint directories]
Besides the engine's checkpoints ([Note: checkpoint format]), two family members write a
model's weights as one safetensors file per piece, through the one checkpoint writer (see
[Note: one checkpoint writer] in ``staged.py``: sealed root record, every file checksummed):

* zero-pipe's ``PipelineModule.save_state_dict`` (and its engine checkpoints of format 2):
  ``pipe_layers.json`` and one ``layer_<idx>-model_<mp>-model_states.safetensors`` per layer
  holding a module, keyed by names inside the layer; the record's ``layer_modules`` gives each
  layer's module name in the ``PipelineModule`` (``layers.<idx>``, ``tied_modules.<key>``);
* zero-moe's ``save_moe_checkpoint``: ``moe_index.json``, ``non_expert.safetensors`` (full
  names) and ``layer_<L>_expert_<G>.safetensors`` per global expert, keyed by names inside the
  expert; the expert's full name is ``<expert_names>.<G>.<key>`` (the record's name of the
  layer's expert list: the names of the model built with ``ep_size=1``).

:func:`open_module_dir` reads either as the converter's checkpoint object (the same methods as
``zero_to_fp32._Checkpoint``): each file is verified against the record before it is read,
floating-point tensors come out as fp32 ("param"), other tensors as stored ("buffer"). Only
zero_core's copy of the converter reads them: the copy of ``zero_to_fp32.py`` inside an engine
checkpoint converts that checkpoint, which is never one of these.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Any

from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.zero_to_fp32 import _check_seal, _Checkpoint, _RankFile, _read_json, _verify

PIPE_INDEX = "pipe_layers.json"
MOE_INDEX = "moe_index.json"
_PIPE_FILE = re.compile(r"^layer_(\d+)-.*model_states\.safetensors$")
_MOE_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)\.safetensors$")
_FLOATS = ("float64", "float32", "float16", "bfloat16")


def find_module_dir(checkpoint_dir: str, tag: Any = None) -> tuple[str, str] | None:
    """``(directory, index file name)`` when ``checkpoint_dir`` (or its tag ``tag`` / the one
    ``latest`` names) is a module-only directory; None otherwise."""
    candidates = [checkpoint_dir]
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, "latest")):
        with open(os.path.join(checkpoint_dir, "latest"), encoding="utf-8") as f:
            tag = f.read().strip()
    if tag is not None:
        candidates.insert(0, os.path.join(checkpoint_dir, str(tag)))
    for d in candidates:
        if os.path.isfile(os.path.join(d, "checkpoint.json")):
            return None  # an engine checkpoint: the converter's own reader
        for index in (PIPE_INDEX, MOE_INDEX):
            if os.path.isfile(os.path.join(d, index)):
                return d, index
    return None


def _pipe_names(meta: dict[str, Any], path: str) -> dict[str, str]:
    """``{file name: module name prefix}`` of a zero-pipe layer directory."""
    modules = meta.get("layer_modules")
    if not isinstance(modules, dict):
        raise CheckpointError(
            f"{path} does not record its layers' module names (written before zero-pipe recorded "
            "layer_modules): load it with PipelineModule.load_state_dir (or the engine's load_checkpoint) "
            "and save it again to convert it"
        )
    out = {}
    for name in meta["files"]:
        m = _PIPE_FILE.match(name)
        if m is None:
            continue  # the engine's optimizer-state files of format 2
        module = modules.get(str(int(m.group(1))))
        if not isinstance(module, str):
            raise CheckpointError(f"{path}: layer_modules has no module for {name}")
        out[name] = module + "."
    return out


def _moe_names(meta: dict[str, Any], path: str) -> dict[str, str]:
    """``{file name: name prefix}`` of a zero-moe expert directory (non-expert file: no prefix)."""
    layers = meta.get("layers")
    if not isinstance(layers, list):
        raise CheckpointError(f"{path} lists no MoE layers (corrupted record)")
    out = {}
    for name in meta["files"]:
        m = _MOE_FILE.match(name)
        if name == "non_expert.safetensors":
            out[name] = ""
        elif m is not None:
            layer = int(m.group(1))
            if layer >= len(layers) or not isinstance(layers[layer].get("module"), str):
                raise CheckpointError(f"{path}: {name} names MoE layer {layer}, which the record lacks")
            module = layers[layer]["module"]
            # records before "expert_names": zero-moe's layout of the time
            experts = layers[layer].get(
                "expert_names", f"{module + '.' if module else ''}zero_moe.experts.zero_experts"
            )
            out[name] = f"{experts}.{int(m.group(2))}."
    return out


class ModuleFiles(_Checkpoint):
    """A module-only directory as the converter's checkpoint object (see [Note: module-only checkpoint directories])."""

    def __init__(self, directory: str, index: str) -> None:  # noqa: D107 (no super().__init__: other layout)
        path = os.path.join(directory, index)
        meta = _read_json(path)
        if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
            raise CheckpointError(f"{path} is not a checkpoint record (no files listed)")
        _check_seal(meta, path)
        if "seal" not in meta:
            raise CheckpointError(f"{path} has no seal: written before checksums, it cannot be verified")
        self.tag_dir, self.layout = directory, index
        prefixes = _pipe_names(meta, path) if index == PIPE_INDEX else _moe_names(meta, path)
        self.tables, self.index, self._files = [], {}, {}
        seen: set[str] = set()
        for fname in sorted(prefixes, key=_file_order):
            rank = len(self.tables)
            self.tables.append({"file": fname, "file_record": meta["files"][fname]})
            f = self._file(rank)
            for key, (dtype, _, _) in f.entries.items():
                name = prefixes[fname] + key
                if name in seen:
                    raise CheckpointError(f"{path}: {name!r} is stored twice ({fname} and another file)")
                seen.add(name)
                kind = "param" if dtype in _FLOATS else "buffer"
                shape = f.shapes[key]
                self.index[(name, kind)] = {
                    "rec": {"shape": list(shape), "dtype": dtype},
                    "pieces": [(0, math.prod(shape), rank, key)],
                }
        # no engine record: the converter takes the names from the files, none tied
        self.meta = {**meta, "parameters": [], "shared_parameters": []}

    def _file(self, rank: int) -> _RankFile:
        if rank not in self._files:
            table = self.tables[rank]
            path = os.path.join(self.tag_dir, table["file"])
            _verify(path, table["file_record"])
            self._files[rank] = _ShapedFile(path)
        return self._files[rank]


class _ShapedFile(_RankFile):
    """A module file read whole by key: the converter's tensor-file reader, keeping each tensor's shape."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        n = struct.unpack("<Q", os.pread(self.fd, 8, 0))[0]
        header = json.loads(os.pread(self.fd, n, 8))
        self.shapes = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def _file_order(name: str) -> tuple[int, ...]:
    """Files in the model's order: layers by index, experts by (layer, global expert), non-expert first."""
    m = _PIPE_FILE.match(name) or _MOE_FILE.match(name)
    return tuple(int(g) for g in m.groups()) if m else (-1,)


def open_module_dir(checkpoint_dir: str, tag: Any = None) -> ModuleFiles | None:
    """The module-only directory at ``checkpoint_dir`` (or its tag), or None when it is not one."""
    found = find_module_dir(os.fspath(checkpoint_dir), tag)
    return None if found is None else ModuleFiles(*found)
