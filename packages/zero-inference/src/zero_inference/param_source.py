"""Where tensor-parallel sharding reads weights from: the live model or safetensors files.

[Note: reading only the shard]
Sharding asks a source for slices (``rows`` / ``cols`` of one named tensor), never for whole
tensors it would then cut. :class:`ModuleSource` slices the model's own tensors;
:class:`SafetensorsSource` uses ``safe_open(...).get_slice`` so a rank reads from disk only the
bytes of its shard, and a model built on the meta device is never materialised in full.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn


class ParamSource(Protocol):
    def names(self) -> set[str]: ...

    def full(self, name: str) -> torch.Tensor: ...

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


class ModuleSource:
    """Slices of the tensors (parameters and buffers) of a live module."""

    def __init__(self, module: nn.Module) -> None:
        self._tensors = dict(module.named_parameters(remove_duplicate=False))
        self._tensors.update(dict(module.named_buffers(remove_duplicate=False)))

    def names(self) -> set[str]:
        return set(self._tensors)

    def full(self, name: str) -> torch.Tensor:
        return self._tensors[name].detach()

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._tensors[name].detach()[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._tensors[name].detach()[:, start:stop]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)


class SafetensorsSource:
    """Tensors of a safetensors file or directory (HF layout: ``model.safetensors`` or an index).

    ``prefixes`` are tried when a name is missing (HF checkpoints of ``GPT2LMHeadModel`` name
    the body ``transformer.h.0...``, but a headless model saves ``h.0...``).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        files: list[str]
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted({os.path.join(path, v) for v in weight_map.values()})
            else:
                files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        elif os.path.isfile(path):
            files = [path]
        else:
            raise FileNotFoundError(f"checkpoint {path!r} is neither a safetensors file nor a directory")
        if not files:
            raise FileNotFoundError(f"checkpoint directory {path!r} holds no .safetensors file")
        self._handles = [safe_open(f, framework="pt") for f in files]
        self._where: dict[str, int] = {}
        for i, h in enumerate(self._handles):
            for key in h.keys():
                self._where[key] = i

    def names(self) -> set[str]:
        return set(self._where)

    def _slice(self, name: str):  # noqa: ANN202 (safetensors' PySafeSlice)
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor named {name!r}")
        return self._handles[self._where[name]].get_slice(name)

    def full(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[:, start:stop]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())


#: A fused projection's output rows as consecutive ``(size, split)`` parts: a split part is cut
#: into ``world`` equal slices (rank ``r`` keeps slice ``r``), a replicated one is kept whole by
#: every rank (the single key/value head of multi-query attention). See [Note: auto TP discovery].
Segments = tuple[tuple[int, bool], ...]


def column_segments(spec: int | Segments, total: int) -> Segments:
    """``spec`` as :data:`Segments`: an int ``k`` means ``k`` equal split blocks of ``total`` rows."""
    if isinstance(spec, int):
        if spec < 1 or total % spec:
            raise ValueError(f"cannot split dimension {total} into {spec} equal block(s)")
        return ((total // spec, True),) * spec
    parts = tuple((int(size), bool(split)) for size, split in spec)
    if sum(size for size, _ in parts) != total:
        raise ValueError(f"fused segments {parts} do not add up to the dimension {total}")
    return parts


def segment_ranges(segments: Segments, rank: int, world: int) -> list[tuple[int, int]]:
    """(start, stop) of this rank's rows in each segment: its slice of a split one, all of a replicated one."""
    out, start = [], 0
    for size, split in segments:
        if split:
            if size % world:
                raise ValueError(
                    f"cannot split a block of {size} features over {world} tensor-parallel ranks"
                )
            per = size // world
            out.append((start + rank * per, start + (rank + 1) * per))
        else:
            out.append((start, start + size))
        start += size
    return out
