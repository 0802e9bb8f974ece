"""The on-disk layout of a checkpoint, and the JSON rules its metadata follows.

[Note: checkpoint format]
A checkpoint is a directory per tag under ``save_dir``::

    save_dir/
      latest                    text file: the newest complete tag (written last, by rank 0)
      zero_to_fp32.py           the consolidation script (also inside each tag, below)
      <tag>/
        checkpoint.json         the commit record (written by rank 0 after every rank finished):
                                format version, world size, stage, dtypes, engine counters, loss
                                scaler, LR scheduler, optimizer param groups, config, client_state,
                                and the size + checksum of every rank's JSON file
        rank_00000.json         rank 0's fragment table (which flat range of which named parameter
                                each stored tensor holds), its RNG states, and the size + checksum
                                of its tensor file
        rank_00000.safetensors  rank 0's tensors (plain safetensors; every rank writes its own in parallel)
        ...
        zero_to_fp32.py         the consolidation script, so a checkpoint converts without this repo

Tensors are stored as *fragments*: a 1-D slice ``[start, end)`` of the flattened value of one
named parameter for one *kind* (``param`` = the module's, possibly 16-bit, weight; ``fp32`` =
the fp32 master; ``optim.<key>`` = an optimizer state such as ``optim.exp_avg``; ``buffer`` =
a module buffer). This is the universal representation: any strategy at any world size picks
the ranges it owns, whatever strategy and world size wrote them. See ``fragments.py``.
zero-pipe's engine checkpoints are this format too, one rank file per stage and replica, with
the pipeline layout in ``checkpoint.json`` (see [Note: universal pipeline checkpoints] in
zero-pipe's ``checkpoint.py``).

Nothing is ever unpickled: tensors are read from safetensors files by ``tensor_file.py`` (a
header of JSON and raw bytes), everything else is JSON. Every file is written to a temporary
name, fsynced and renamed (``atomic.py``); a whole tag is first written into a hidden staging
directory that rank 0 renames into place only after a barrier, then ``latest`` is replaced.
A crash at any point therefore leaves the previous tag complete and ``latest`` naming it.
Checksums (``integrity.py``) chain: ``checkpoint.json`` -> every ``rank_*.json`` -> every
``rank_*.safetensors``; a mismatch raises an error naming the file, and ``checkpoint.json``
carries its own seal and is range-checked (see [Note: sealed metadata] in ``metadata.py``).
Format version 3 records every file with a CRC-32C per 64 MiB (see [Note: checkpoint
checksum]); versions 1 (CRC32) and 2 (``sum64`` for tensor files) still load.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import torch

FORMAT_NAME = "zero-checkpoint"
# 2: rank tensor files recorded with sum64 instead of crc32; 3: every file with per-piece crc32c
# (integrity.py) and checkpoint.json sealed (metadata.py)
FORMAT_VERSION = 3
LATEST_FILE = "latest"
COMMIT_FILE = "checkpoint.json"
SCRIPT_FILE = "zero_to_fp32.py"

_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}$")

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and what is wrong."""


def rank_json_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def rank_tensor_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def staging_dir_name(tag: str) -> str:
    """Hidden directory a tag is written into before it is renamed into place."""
    return f".{tag}.partial"


def validate_tag(tag: object) -> str:
    """A tag must be a non-empty path-safe name (it becomes a directory name)."""
    if isinstance(tag, int) and not isinstance(tag, bool):
        tag = str(tag)
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag in (".", ".."):
        raise ValueError(
            f"checkpoint tag must be a string of letters, digits and . _ + = @ - (not starting with a "
            f"punctuation mark, at most 200 characters), got {tag!r}"
        )
    return tag


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CheckpointError(
            f"tensors of dtype {dtype} cannot be checkpointed (allowed: {sorted(_DTYPES)})"
        ) from None


def dtype_from_name(name: str, where: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: unknown dtype {name!r} (known: {sorted(_DTYPES)})") from None


def check_json_compatible(value: object, where: str) -> None:
    """Raise ``TypeError`` naming the path of the first value JSON cannot hold exactly.

    Allowed: dict with str keys, list, tuple (comes back as a list), str, int, finite or
    non-finite float, bool, None. This is what makes ``client_state`` loadable without pickle.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json_compatible(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict keys must be str to be saved as JSON, got key {k!r}")
            check_json_compatible(v, f"{where}[{k!r}]")
        return
    kind = "a tensor" if torch.is_tensor(value) else f"a {type(value).__name__}"
    raise TypeError(
        f"{where} is {kind}; checkpoint metadata must be JSON-compatible (dict with str keys, list, str, int, "
        "float, bool, None) because checkpoints never use pickle. Convert it (e.g. tensor.tolist()) first."
    )


# [Note: JSON float tags]
# JSON has no inf/nan: they are spelled as the tagged object {"__float__": "inf"}. So that a
# saved dict (client_state) can never look like a tag, a key equal to "__float__" or starting with
# KEY_ESCAPE is written with KEY_ESCAPE in front, and the reader takes one KEY_ESCAPE off. Without
# it {"__float__": "x"} came back as a float, or made the whole checkpoint unreadable.
FLOAT_TAG = "__float__"
KEY_ESCAPE = "__zero_key__"


def _escape_key(key: str) -> str:
    return KEY_ESCAPE + key if key == FLOAT_TAG or key.startswith(KEY_ESCAPE) else key


def _encode_floats(value: object) -> object:
    # JSON has no inf/nan: spell them as tagged objects so they round-trip exactly.
    if isinstance(value, float) and not math.isfinite(value):
        return {FLOAT_TAG: repr(value)}
    if isinstance(value, dict):
        return {_escape_key(k): _encode_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_floats(v) for v in value]
    return value


def _decode_hook(obj: dict[str, object]) -> object:
    if len(obj) == 1 and FLOAT_TAG in obj:
        return float(obj[FLOAT_TAG])
    if any(k.startswith(KEY_ESCAPE) for k in obj):
        return {k[len(KEY_ESCAPE) :] if k.startswith(KEY_ESCAPE) else k: v for k, v in obj.items()}
    return obj


def dumps(value: object) -> bytes:
    return json.dumps(_encode_floats(value), indent=1, sort_keys=True, allow_nan=False).encode()


def loads(data: bytes, where: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"), object_hook=_decode_hook)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e}); the file is corrupted") from None


def read_json(path: str) -> Any:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist")
    with open(path, "rb") as f:
        return loads(f.read(), path)
