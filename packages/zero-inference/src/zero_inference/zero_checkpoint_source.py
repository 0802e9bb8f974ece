"""Inference weights from this project's training checkpoints (``engine.save_checkpoint``).

[Note: loading a zero training checkpoint]
A zero training checkpoint (see [Note: checkpoint format] in ``zero_core.checkpoint.format``)
stores every parameter as 1-D fragments of its flattened value, spread over the training
ranks' files, whatever ZeRO stage and world size wrote it. :class:`ZeroCheckpointSource`
serves the :class:`~zero_inference.param_source.ParamSource` calls from
``zero_core.checkpoint.CheckpointReader`` ranged reads:

* ``rows(a, b)`` of a ``[R, C]`` tensor is the one flat range ``[a*C, b*C)``;
* ``cols(a, b)`` is one flat range ``[r*C + a, r*C + b)`` per row ``r``;
* parameters come from the fp32 master (``fp32`` fragments, or the module weight where no
  separate master was saved), buffers from the ``buffer`` fragments.

So a tensor-parallel rank reads only the bytes of its own shards (plus the replicated tensors),
never the full model. The reader verifies a training rank's file checksum the first time it
reads from it. ``checkpoint=`` names the save directory (its ``latest`` tag is used) or one tag
directory inside it.
"""

from __future__ import annotations

import math
import os

import torch
from zero_core.checkpoint.format import COMMIT_FILE, LATEST_FILE
from zero_core.checkpoint.fragments import BUFFER, PARAM

__all__ = ["ZeroCheckpointSource", "is_zero_checkpoint"]


def is_zero_checkpoint(path: str) -> bool:
    """Whether ``path`` is a zero training checkpoint save directory or tag directory."""
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, LATEST_FILE)) or os.path.isfile(os.path.join(path, COMMIT_FILE))
    )


class ZeroCheckpointSource:
    """A :class:`ParamSource` over a zero training checkpoint. See [Note: loading a zero training checkpoint]."""

    def __init__(self, path: str, tag: str | None = None) -> None:
        from zero_core.checkpoint.loader import open_checkpoint, resolve_tag

        path = os.fspath(path)
        if os.path.isfile(os.path.join(path, COMMIT_FILE)):  # a tag directory
            load_dir, tag_dir = os.path.split(os.path.normpath(path))
            tag = tag or tag_dir
        else:
            load_dir = path
            tag = resolve_tag(load_dir, tag)
            if tag is None:
                raise FileNotFoundError(f"zero checkpoint {path!r} has no '{LATEST_FILE}' file naming a tag")
        self.path = os.path.join(load_dir, tag)
        self.meta, self.reader = open_checkpoint(load_dir, tag)
        self._kind: dict[str, str] = {n: PARAM for n in self.reader.names(PARAM)}
        self._kind.update({n: PARAM for n in self.reader.names("fp32")})
        self._kind.update({n: BUFFER for n in self.reader.names(BUFFER)})

    def names(self) -> set[str]:
        return set(self._kind)

    def _read(self, name: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        if name not in self._kind:
            raise KeyError(f"zero checkpoint {self.path} has no tensor named {name!r}")
        if self._kind[name] == BUFFER:
            return self.reader.read(name, BUFFER, start, end)
        return self.reader.read_fp32(name, start, end)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._kind:
            raise KeyError(f"zero checkpoint {self.path} has no tensor named {name!r}")
        kind = self._kind[name]
        if kind == PARAM and not self.reader.has(name, PARAM):
            kind = "fp32"
        return tuple(self.reader.shape(name, kind))

    def full(self, name: str) -> torch.Tensor:
        return self._read(name).reshape(self.shape(name)).clone()

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        shape = self.shape(name)
        inner = math.prod(shape[1:])
        return self._read(name, start * inner, stop * inner).reshape(stop - start, *shape[1:]).clone()

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        shape = self.shape(name)
        if len(shape) != 2:
            raise ValueError(f"cols() needs a 2-D tensor, {name!r} has shape {shape}")
        rows, width = shape
        out = torch.empty(rows, stop - start, dtype=torch.float32)
        for r in range(rows):
            out[r] = self._read(name, r * width + start, r * width + stop)
        return out

    def close(self) -> None:
        self.reader.close()
