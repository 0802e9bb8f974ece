"""Random number generator states as tensors and JSON (never pickled).

Exact resume needs every rank's generators back where they were: torch's CPU generator (a
uint8 tensor), the accelerator's (one per device), Python's ``random`` and NumPy's global
generator. Tensors go into the rank's safetensors file, the rest into its JSON.

``save_rank_file`` / ``load_rank_file`` keep them in a pair of files of their own
(``<name>_<rank>.safetensors`` and ``.json``) for callers that restore the generators at
another moment than the engine's load: the Trainer restores them after it skipped the
batches already trained on (see [Note: Trainer checkpoints] in ``integrations/hf_trainer_checkpoint.py``).
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from zero_core.checkpoint.atomic import atomic_write_bytes
from zero_core.checkpoint.format import CheckpointError, dumps, read_json
from zero_core.checkpoint.integrity import verify_file
from zero_core.checkpoint.tensor_file import TensorEntry, TensorFile, write_tensor_file

try:  # numpy ships with torch wheels, but is optional for torch itself
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

TORCH_CPU = "rng:torch_cpu"
NUMPY_KEYS = "rng:numpy_keys"
_CUDA = "rng:cuda:"


def capture() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {TORCH_CPU: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{_CUDA}{i}"] = s
    version, internal, gauss = random.getstate()
    meta: dict[str, Any] = {"python": [version, list(internal), gauss]}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        tensors[NUMPY_KEYS] = torch.from_numpy(keys.astype(np.int64))
        meta["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    return tensors, meta


def restore(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    if TORCH_CPU in tensors:
        torch.set_rng_state(tensors[TORCH_CPU])
    cuda = sorted(k for k in tensors if k.startswith(_CUDA))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    if "python" in meta:
        version, internal, gauss = meta["python"]
        random.setstate((version, tuple(internal), gauss))
    if np is not None and "numpy" in meta and NUMPY_KEYS in tensors:
        kind, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((kind, tensors[NUMPY_KEYS].numpy().astype(np.uint32), pos, has_gauss, cached))


def save_rank_file(directory: str, name: str, rank: int, world_size: int) -> None:
    """Write this process's generators to ``directory/<name>_<rank>.safetensors`` and ``.json``
    (atomically; the JSON, written last, records the tensor file's size and checksums)."""
    tensors, meta = capture()
    stem = os.path.join(directory, f"{name}_{rank}")
    entries = [TensorEntry(k, tuple(t.shape), t.dtype, (lambda t=t: t)) for k, t in tensors.items()]
    record = write_tensor_file(stem + ".safetensors", entries)
    table = {
        "rank": rank,
        "world_size": world_size,
        "file": os.path.basename(stem) + ".safetensors",
        "file_record": record,
        "rng": meta,
        "rng_tensors": sorted(tensors),
    }
    atomic_write_bytes(stem + ".json", dumps(table))


def load_rank_file(directory: str, name: str, rank: int, world_size: int) -> str | None:
    """Restore the generators ``save_rank_file`` wrote for ``rank``; ``None`` when done.

    Otherwise the reason nothing was restored (no file for this rank, or one saved at another
    world size, whose rank ``rank`` is not this process's twin: the caller says so). A file
    that is there but damaged raises :class:`CheckpointError` naming it.
    """
    stem = os.path.join(directory, f"{name}_{rank}")
    if not os.path.isfile(stem + ".json"):
        return f"{stem}.json does not exist"
    table = read_json(stem + ".json")
    if not (
        isinstance(table, dict)
        and isinstance(table.get("rng_tensors"), list)
        and isinstance(table.get("file_record"), dict)
    ):
        raise CheckpointError(
            f"{stem}.json is not a random-generator record (needs 'rng_tensors' and 'file_record')"
        )
    if table.get("world_size") != world_size:
        return f"{stem}.json was saved at world size {table.get('world_size')}, this run has {world_size}"
    path = os.path.join(directory, os.path.basename(str(table.get("file"))))
    verify_file(path, table["file_record"])
    with TensorFile(path) as f:
        restore({k: f.read_tensor(k) for k in table["rng_tensors"]}, table.get("rng", {}))
    return None
