#!/usr/bin/env python
"""Consolidate a zero checkpoint into one fp32 state dict (``deepspeed.utils.zero_to_fp32``).

Usage as a script (this file is also copied into every checkpoint directory)::

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT [--tag TAG] [--max-shard-size 5GB]
                           [--exclude-frozen-parameters] [--bin]

``CHECKPOINT_DIR`` is the directory holding ``latest`` and the tag directories (a tag
directory itself also works). ``OUTPUT`` is a ``.safetensors`` file (or ``.bin`` with
``--bin``); when the model is larger than ``--max-shard-size`` it becomes Hugging Face style
shards ``<stem>-00001-of-0000N.safetensors`` next to it plus ``<OUTPUT>.index.json``.

[Note: streaming conversion]
The fp32 value of each parameter is assembled from the fragments of every rank (whatever
world size and stage wrote them) and written to the output immediately, one tensor at a
time, so the peak memory of a safetensors conversion is about the largest single tensor,
independent of the model size (``.bin`` output needs one whole shard in memory, since
``torch.save`` takes a dict). Nothing is unpickled on the way in.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch

from zero_core.checkpoint.atomic import atomic_write_bytes
from zero_core.checkpoint.format import COMMIT_FILE, CheckpointError
from zero_core.checkpoint.fragments import BUFFER, FP32, PARAM, CheckpointReader
from zero_core.checkpoint.loader import open_checkpoint, resolve_tag
from zero_core.checkpoint.tensor_file import TensorEntry, write_tensor_file

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units as Hugging Face; KiB/MiB/GiB binary)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = _SIZE_RE.match(str(size)) if isinstance(size, str) else None
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"max_shard_size must be a positive byte count or a string like '5GB', '500MB', got {size!r}"
        )
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def _open(checkpoint_dir: str | os.PathLike[str], tag: Any) -> tuple[dict[str, Any], CheckpointReader]:
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a path, got {type(checkpoint_dir).__name__}")
    checkpoint_dir = os.fspath(checkpoint_dir)
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, COMMIT_FILE)):
        checkpoint_dir, tag = os.path.split(os.path.abspath(checkpoint_dir))
    resolved = resolve_tag(checkpoint_dir, tag)
    if resolved is None:
        raise CheckpointError(
            f"{checkpoint_dir} has no 'latest' file; pass tag= (one of its tag directories)"
        )
    return open_checkpoint(checkpoint_dir, resolved)


def _plan(meta: dict[str, Any], reader: CheckpointReader, exclude_frozen: bool) -> list[tuple[str, str]]:
    """(name, kind) of every output tensor, in the model's parameter order, then buffers."""
    order = [n for n, _, _ in meta.get("parameters", [])] or reader.names(PARAM)
    frozen = {n for n, rg, _ in meta.get("parameters", []) if not rg}
    out = []
    for name in order:
        if exclude_frozen and name in frozen:
            continue
        if reader.has(name, FP32) or reader.has(name, PARAM):
            out.append((name, FP32))
    out += [(n, BUFFER) for n in reader.names(BUFFER)]
    return out


def _shape_dtype(reader: CheckpointReader, name: str, kind: str) -> tuple[tuple[int, ...], torch.dtype]:
    if kind == BUFFER:
        return reader.shape(name, BUFFER), reader.dtype(name, BUFFER)
    return reader.shape(name, FP32 if reader.has(name, FP32) else PARAM), torch.float32


def _value(reader: CheckpointReader, name: str, kind: str) -> torch.Tensor:
    if kind == BUFFER:
        return reader.read_full(name, BUFFER)
    shape, _ = _shape_dtype(reader, name, kind)
    return reader.read_fp32(name).view(shape)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: Any = None, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The consolidated fp32 weights (and buffers) of a checkpoint, as an in-memory state dict on CPU."""
    meta, reader = _open(checkpoint_dir, tag)
    try:
        return {
            name: _value(reader, name, kind) for name, kind in _plan(meta, reader, exclude_frozen_parameters)
        }
    finally:
        reader.close()


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: Any = None
) -> torch.nn.Module:
    """Load the consolidated fp32 weights into ``model`` (moved to CPU) and return it.

    The model is no longer usable with the engine it came from: re-create the engine to continue training.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"load_state_dict_from_zero_checkpoint: model must be a torch.nn.Module, got {type(model)}"
        )
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


class _Progress:
    """tqdm when installed, else a line every 10%."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self._next = max(total, 1), 0, enabled, 0.1
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="zero_to_fp32")
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and self.done / self.total >= self._next:
            print(f"zero_to_fp32: {100 * self.done / self.total:.0f}% ({self.done} bytes)", flush=True)
            self._next += 0.1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _shards(entries: list[TensorEntry], max_bytes: int) -> Iterator[list[TensorEntry]]:
    shard: list[TensorEntry] = []
    size = 0
    for e in entries:
        if shard and size + e.nbytes > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append(e)
        size += e.nbytes
    if shard:
        yield shard


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str],
    tag: Any = None,
    exclude_frozen_parameters: bool = False,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    progress: bool = True,
) -> list[str]:
    """Write the consolidated fp32 state dict to ``output_file`` (sharded past ``max_shard_size``).

    Streams tensor by tensor (see [Note: streaming conversion]). Returns the files written.
    """
    if not isinstance(output_file, (str, os.PathLike)):
        raise TypeError(f"output_file must be a path, got {type(output_file).__name__}")
    output_file = os.fspath(output_file)
    limit = parse_size(max_shard_size)
    meta, reader = _open(checkpoint_dir, tag)
    try:
        entries = []
        for name, kind in _plan(meta, reader, exclude_frozen_parameters):
            shape, dtype = _shape_dtype(reader, name, kind)
            entries.append(TensorEntry(name, shape, dtype, (lambda n=name, k=kind: _value(reader, n, k))))
        shards = list(_shards(entries, limit))
        out_dir = os.path.dirname(os.path.abspath(output_file))
        os.makedirs(out_dir, exist_ok=True)
        stem, ext = os.path.splitext(os.path.basename(output_file))
        ext = ext or (".safetensors" if safe_serialization else ".bin")
        names = (
            [os.path.basename(output_file)]
            if len(shards) == 1
            else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}" for i in range(len(shards))]
        )
        bar = _Progress(sum(e.nbytes for e in entries), progress)
        written = []
        weight_map = {}
        for fname, shard in zip(names, shards):
            path = os.path.join(out_dir, fname)
            if safe_serialization:
                write_tensor_file(
                    path, shard, metadata={"format": "pt"}, on_tensor=lambda e: bar.update(e.nbytes)
                )
            else:
                _torch_save_atomic({e.name: e.produce() for e in shard}, path)
                bar.update(sum(e.nbytes for e in shard))
            written.append(path)
            weight_map.update({e.name: fname for e in shard})
        bar.close()
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
            index_path = os.path.join(out_dir, f"{stem}{ext}.index.json")
            atomic_write_bytes(index_path, json.dumps(index, indent=2, sort_keys=True).encode())
            written.append(index_path)
        return written
    finally:
        reader.close()


def _torch_save_atomic(state: dict[str, torch.Tensor], path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Consolidate a zero checkpoint into an fp32 state dict.")
    parser.add_argument("checkpoint_dir", help="directory with 'latest' and tag folders (or one tag folder)")
    parser.add_argument("output", help="output file (.safetensors, or .bin with --bin)")
    parser.add_argument("-t", "--tag", default=None, help="tag to convert (default: the one 'latest' names)")
    parser.add_argument(
        "--max-shard-size", default="5GB", help="shard the output past this size (default 5GB)"
    )
    parser.add_argument("--exclude-frozen-parameters", action="store_true")
    parser.add_argument("--bin", action="store_true", help="write torch .bin (pickle) instead of safetensors")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        files = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
            max_shard_size=args.max_shard_size,
            safe_serialization=not args.bin,
            progress=not args.quiet,
        )
    except (CheckpointError, ValueError, TypeError) as e:
        print(f"zero_to_fp32: error: {e}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
