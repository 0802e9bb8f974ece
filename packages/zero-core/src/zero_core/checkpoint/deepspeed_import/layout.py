"""Where the files of a DeepSpeed checkpoint are, and which kinds this importer reads.

DeepSpeed's ``engine.save_checkpoint(save_dir)`` writes ``save_dir/latest`` (the tag as text)
and ``save_dir/<tag>/`` holding:

* ``mp_rank_00_model_states.pt`` (stages 0-2): the module state dict, the counters, the LR
  scheduler, the flat-group layout (``param_shapes``), and at stage 0 the optimizer itself;
* ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (stage 3): the same, one per data-parallel
  rank, each with that rank's shards of frozen parameters;
* ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (stages 1-3, and the bf16
  optimizer): rank ``r``'s partition of the fp32 masters and optimizer states.

Tensor-parallel (``mp_rank_01``), pipeline (``layer_*``) and MoE (``expert_*``) files, and
NVMe-offloaded states (``offloaded_tensors/``) are not imported: they are refused by name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from zero_core.checkpoint.format import COMMIT_FILE, LATEST_FILE, CheckpointError

_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_UNSUPPORTED = (
    (
        re.compile(r"^(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$|^expp_rank_\d+_"),
        "a Mixture-of-Experts checkpoint",
    ),
    (
        re.compile(r"^layer_\d+-model_\d+-model_states\.pt$"),
        "a pipeline-parallel (PipelineModule) checkpoint",
    ),
)


@dataclass
class DeepSpeedFolder:
    """The files of one tag of a DeepSpeed checkpoint, ordered by data-parallel rank."""

    tag_dir: str
    tag: str
    model_files: list[str]  # one (stages 0-2) or one per rank (stage 3)
    optim_files: list[str] = field(default_factory=list)  # one per rank; none at stage 0
    partitioned_weights: bool = False  # per-rank model-state files: ZeRO stage 3

    @property
    def world_size(self) -> int:
        return max(len(self.optim_files), len(self.model_files))


def _looks_like_deepspeed(tag_dir: str) -> bool:
    if not os.path.isdir(tag_dir) or os.path.isfile(os.path.join(tag_dir, COMMIT_FILE)):
        return False
    return any(_MODEL_RE.match(n) or _OPTIM_RE.match(n) for n in os.listdir(tag_dir))


def _read_latest(ds_dir: str) -> str | None:
    path = os.path.join(ds_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        tag = f.read().strip()
    if not tag or os.path.basename(tag) != tag or tag in (".", ".."):
        raise CheckpointError(f"{path} names {tag!r}, which is not a tag directory name (corrupted file?)")
    return tag


def is_deepspeed_checkpoint(path: str | os.PathLike[str], tag: str | None = None) -> bool:
    """Whether ``path`` (a save directory, or one tag directory) holds a DeepSpeed checkpoint."""
    path = os.fspath(path)
    if _looks_like_deepspeed(path):
        return True
    try:
        tag = tag if tag is not None else _read_latest(path)
    except CheckpointError:
        return False
    return tag is not None and _looks_like_deepspeed(os.path.join(path, str(tag)))


def _tag_dir(ds_dir: str, tag: str | None) -> tuple[str, str]:
    if tag is None and _looks_like_deepspeed(ds_dir):  # given the tag directory itself
        return ds_dir, os.path.basename(os.path.normpath(ds_dir))
    if tag is None:
        tag = _read_latest(ds_dir)
        if tag is None:
            raise CheckpointError(
                f"{ds_dir} has no 'latest' file and no tag was given: pass the tag (e.g. tag='global_step100', "
                "--tag global_step100) or a tag directory"
            )
    tag = str(tag)
    if os.path.basename(tag) != tag or tag in (".", ".."):
        raise CheckpointError(f"tag must be a directory name inside {ds_dir}, got {tag!r}")
    tag_dir = os.path.join(ds_dir, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"DeepSpeed checkpoint tag directory {tag_dir} does not exist")
    return tag_dir, tag


def _ranked(tag_dir: str, names: dict[int, str], what: str) -> list[str]:
    missing = [r for r in range(max(names) + 1) if r not in names]
    if missing:
        raise CheckpointError(
            f"{tag_dir}: the {what} files of data-parallel ranks {missing} are missing (a rank did not finish "
            "saving, or files were deleted)"
        )
    return [os.path.join(tag_dir, names[r]) for r in range(len(names))]


def _refuse_unsupported(tag_dir: str, names: list[str]) -> None:
    for name in names:
        for pattern, what in _UNSUPPORTED:
            if pattern.match(name):
                raise CheckpointError(f"{tag_dir} is {what} ({name}); importing those is not supported")
    if "offloaded_tensors" in names:
        raise CheckpointError(
            f"{tag_dir} holds offloaded_tensors/: its optimizer states were swapped to NVMe and are not in the "
            "rank files; importing those is not supported (save without offload_optimizer nvme)"
        )


def find_checkpoint(ds_dir: str | os.PathLike[str], tag: str | None = None) -> DeepSpeedFolder:
    """The files of ``tag`` (default: the one ``latest`` names) of the DeepSpeed checkpoint in ``ds_dir``.

    ``ds_dir`` may also be a tag directory. Raises :class:`CheckpointError` naming what is
    missing or not supported.
    """
    if not isinstance(ds_dir, (str, os.PathLike)):
        raise TypeError(f"from_deepspeed: ds_dir must be a path, got {type(ds_dir).__name__}")
    ds_dir = os.fspath(ds_dir)
    if not os.path.isdir(ds_dir):
        raise CheckpointError(f"{ds_dir} is not a directory")
    tag_dir, tag = _tag_dir(ds_dir, tag)
    names = sorted(os.listdir(tag_dir))
    _refuse_unsupported(tag_dir, names)
    model: dict[int, str] = {}
    optim: dict[int, str] = {}
    for name in names:
        m, o = _MODEL_RE.match(name), _OPTIM_RE.match(name)
        mp = (m.group(2) if m else o.group(3)) if (m or o) else None
        if mp is not None and int(mp) != 0:
            raise CheckpointError(
                f"{tag_dir} holds {name}: a tensor-parallel checkpoint (model-parallel rank {int(mp)}); importing "
                "those is not supported"
            )
        if m:
            model[int(m.group(1) or 0)] = name
        elif o:
            optim[int(o.group(2))] = name
    if not model:
        raise CheckpointError(
            f"{tag_dir} holds no mp_rank_00_model_states.pt (nor zero_pp_rank_*_mp_rank_00_model_states.pt): not a "
            "DeepSpeed checkpoint tag directory"
        )
    folder = DeepSpeedFolder(tag_dir, tag, _ranked(tag_dir, model, "model-state"))
    folder.partitioned_weights = any(_MODEL_RE.match(n).group(1) is not None for n in model.values())
    if optim:
        folder.optim_files = _ranked(tag_dir, optim, "optimizer-state")
    if len(folder.model_files) > 1 and len(folder.model_files) != len(folder.optim_files):
        raise CheckpointError(
            f"{tag_dir} holds {len(folder.model_files)} per-rank model-state files but {len(folder.optim_files)} "
            "optimizer-state files: the checkpoint is incomplete"
        )
    return folder
