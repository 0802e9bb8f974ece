"""Loading inference weights from checkpoints, and writing the TP-sharded checkpoint.

[Note: inference checkpoint formats]
Read:
* a Hugging Face safetensors file or directory (``model.safetensors``, or shards listed in
  ``model.safetensors.index.json``): each rank reads only its slices (see
  [Note: reading only the shard]) and the replicated tensors;
* a JSON load policy (dict, or path to a ``.json``) ``{"type": ..., "checkpoints": [files],
  "base_dir": ...}`` naming safetensors files (relative to ``base_dir``);
* this package's TP-sharded format, written by ``save_mp_checkpoint_path``: a directory with
  ``zero_inference_tp.json`` (``{"format": "zero-inference-tp", "version": 1, "tp_size": N,
  "dtype": ..., "files": [...], "aliases": {...}}``) and one ``tp_rank_XX.safetensors`` per rank
  holding that rank's state dict after sharding. Reload with the same ``tp_size`` reads one
  file per rank and no slicing at all; reload with another ``tp_size`` re-slices from the
  saved shards (version 2 indexes record ``layouts`` and ``shapes``, see
  [Note: re-sharding a TP checkpoint]);
* a zero training checkpoint (``engine.save_checkpoint``'s directory, see
  [Note: loading a zero training checkpoint]), read range by range for this rank. Tensors shared under several names (tied embeddings) are
  stored once; ``aliases`` maps the other names to it.
Writes are atomic (temporary file, fsync, rename) and never use pickle.

To avoid materialising the full model before loading, build it with :func:`empty_model`
(parameters on the meta device, buffers real) and pass ``checkpoint=``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import nn
from zero_core.checkpoint.atomic import atomic_write_json, atomic_write_safetensors

from zero_inference.param_source import SafetensorsSource
from zero_inference.tp_reshard import TPReshardSource, plan_layouts
from zero_inference.zero_checkpoint_source import ZeroCheckpointSource, is_zero_checkpoint

if TYPE_CHECKING:
    from zero_inference.auto_tp import TPPlan

INDEX_NAME = "zero_inference_tp.json"
FORMAT = "zero-inference-tp"


@contextlib.contextmanager
def empty_model() -> Iterator[None]:
    """Inside this context, new modules get their parameters on the meta device (buffers stay real)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


class TPShardSource:
    """One rank's file of our TP-sharded format."""

    def __init__(self, path: str) -> None:
        with open(os.path.join(path, INDEX_NAME)) as f:
            self.index = json.load(f)
        if self.index.get("format") != FORMAT:
            raise ValueError(
                f"{path}/{INDEX_NAME}: not a {FORMAT} index (format={self.index.get('format')!r})"
            )
        self.path = path
        self.tp_size = int(self.index["tp_size"])
        self.rank: int | None = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        sd = load_file(os.path.join(self.path, self.index["files"][self.rank]))
        for alias, canonical in self.index.get("aliases", {}).items():
            sd[alias] = sd[canonical]
        return sd


def _policy_files(policy: dict[str, Any], base_dir: str) -> list[str]:
    files = policy.get("checkpoints")
    if isinstance(files, dict):  # {"non_tp": [...], "tp": [...]} in DeepSpeed's policy files
        files = [f for v in files.values() for f in (v if isinstance(v, list) else [v])]
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ValueError(
            f"checkpoint load policy: 'checkpoints' must be a non-empty list of file names, got {files!r}"
        )
    base = policy.get("base_dir") or base_dir
    return [os.path.join(base, f) if base else f for f in files]


def open_checkpoint(checkpoint: str | dict[str, Any], base_dir: str | None = None) -> Any:
    """A source for ``checkpoint`` (see [Note: inference checkpoint formats])."""
    base_dir = base_dir or ""
    if isinstance(checkpoint, dict):
        return _MultiSource([SafetensorsSource(f) for f in _policy_files(checkpoint, base_dir)])
    path = os.path.join(base_dir, checkpoint) if base_dir and not os.path.isabs(checkpoint) else checkpoint
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX_NAME)):
        return TPShardSource(path)
    if is_zero_checkpoint(path):
        return ZeroCheckpointSource(path)
    if path.endswith(".json") and os.path.isfile(path):
        with open(path) as f:
            policy = json.load(f)
        return _MultiSource(
            [SafetensorsSource(f) for f in _policy_files(policy, base_dir or os.path.dirname(path))]
        )
    if path.endswith((".pt", ".bin", ".pth")):
        raise ValueError(
            f"checkpoint {path!r}: pickle checkpoints are not loaded (unsafe); convert to safetensors"
        )
    return SafetensorsSource(path)


class _MultiSource:
    """Several safetensors sources seen as one."""

    def __init__(self, sources: list[SafetensorsSource]) -> None:
        self._by_name = {n: s for s in sources for n in s.names()}

    def names(self) -> set[str]:
        return set(self._by_name)

    def full(self, name: str) -> torch.Tensor:
        return self._by_name[name].full(name)

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        return self._by_name[name].rows(name, a, b)

    def cols(self, name: str, a: int, b: int) -> torch.Tensor:
        return self._by_name[name].cols(name, a, b)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._by_name[name].shape(name)


def check_tp(source: Any, tp_size: int, rank: int) -> Any:
    """``source`` ready for this rank: a TP checkpoint of another ``tp_size`` becomes a re-slicing source."""
    if isinstance(source, TPShardSource):
        if source.tp_size != tp_size:
            return TPReshardSource(source.path, source.index)
        source.rank = rank
    return source


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    if is_param:
        module._parameters[name] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[name] = value


def load_replicated(
    model: nn.Module, source: Any, plan: TPPlan | None, dtype: torch.dtype | None, device: torch.device
) -> None:
    """Load every tensor of ``model`` outside the planned (sharded) modules from ``source``, whole."""
    sharded = set()
    if plan is not None:
        sharded = (
            set(plan.column)
            | set(plan.row)
            | set(plan.embeddings)
            | ({plan.lm_head} if plan.lm_head else set())
        )
    names = source.names()
    groups: dict[int, list[tuple[str, nn.Module, str, bool]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        if mod_name in sharded:
            continue
        for kind, table in ((True, module._parameters), (False, module._buffers)):
            for local, t in table.items():
                if t is None:
                    continue
                full = f"{mod_name}.{local}" if mod_name else local
                groups.setdefault(id(t), []).append((full, module, local, kind))
    for entries in groups.values():
        found = next((e[0] for e in entries if e[0] in names), None)
        if found is None:
            if any(e[0] in sharded for e in entries):
                continue
            if any(
                e[1]._parameters.get(e[2]) is not None and e[1]._parameters[e[2]].is_meta
                for e in entries
                if e[3]
            ) or any(not e[3] and e[1]._buffers[e[2]].is_meta for e in entries):
                raise KeyError(
                    f"checkpoint has no tensor for {entries[0][0]} (and the model holds no value for it)"
                )
            for _full, module, local, is_param in entries:  # not in the checkpoint: keep the model's value
                t = module._parameters[local] if is_param else module._buffers[local]
                t.data = t.data.to(dtype=dtype if t.is_floating_point() and dtype else t.dtype, device=device)
            continue
        value = source.full(found)
        if value.is_floating_point() and dtype is not None:
            value = value.to(dtype)
        value = value.to(device)
        shared = None
        for _full, module, local, is_param in entries:
            if is_param:
                if shared is None:
                    shared = nn.Parameter(value, requires_grad=False)
                module._parameters[local] = shared
            else:
                module._buffers[local] = value


def load_rank_shard(
    model: nn.Module, source: TPShardSource, dtype: torch.dtype | None, device: torch.device
) -> None:
    """Load this rank's file of our TP-sharded format into the (already sharded) model."""
    sd = source.state_dict()
    for k, v in sd.items():
        if v.is_floating_point() and dtype is not None:
            sd[k] = v.to(dtype)
        sd[k] = sd[k].to(device)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if unexpected or [m for m in missing if m not in _non_persistent(model)]:
        raise ValueError(
            f"TP checkpoint {source.path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for p in model.parameters():
        p.requires_grad_(False)


def _non_persistent(model: nn.Module) -> set[str]:
    out = set()
    for name, m in model.named_modules():
        for b in getattr(m, "_non_persistent_buffers_set", ()):
            out.add(f"{name}.{b}" if name else b)
    return out


def save_mp_checkpoint(
    model: nn.Module,
    path: str,
    rank: int,
    tp_size: int,
    plan: TPPlan | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Write this rank's sharded state dict (and, on rank 0, the index). See [Note: inference checkpoint formats]."""
    os.makedirs(path, exist_ok=True)
    sd = model.state_dict(keep_vars=False)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    dtype = None
    for name, t in sd.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous().cpu()
        if t.is_floating_point() and dtype is None:
            dtype = str(t.dtype).removeprefix("torch.")
    files = [f"tp_rank_{r:02d}.safetensors" for r in range(tp_size)]
    # See [Note: one atomic writer] in zero_core/checkpoint/atomic.py
    atomic_write_safetensors(
        os.path.join(path, files[rank]), tensors, {"format": FORMAT, "tp_rank": str(rank)}
    )
    if rank == 0:
        layouts, full_shapes = plan_layouts(plan, shapes or {})
        atomic_write_json(
            os.path.join(path, INDEX_NAME),
            {
                "format": FORMAT,
                "version": 2,
                "layouts": layouts,
                "shapes": full_shapes,
                "tp_size": tp_size,
                "dtype": dtype,
                "files": files,
                "aliases": aliases,
            },
        )
