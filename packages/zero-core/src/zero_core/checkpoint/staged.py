"""The one checkpoint writer: a tag is staged, checksummed, committed atomically, ``latest`` last.

[Note: one checkpoint writer]
Every checkpoint zero writes (the engine's ``save_checkpoint``, zero-pipe's per-layer
checkpoints, zero-moe's per-expert checkpoints) goes through this module, so they share one
crash-safety argument (issue 25, item 2: zero-pipe wrote straight into ``<save_dir>/<tag>``
and moved ``latest`` regardless, so a rank killed while re-saving a tag left layers of two
steps that loaded without error):

1. ``begin``: the tag is validated (``format.validate_tag``: a plain name, never ``..`` or a
   path) before anything is written; rank 0 empties the staging directory
   ``<save_dir>/.<tag>.partial``; agreement (a barrier at which a failure on any rank becomes
   the same error on every rank: [Note: collective save outcome] in ``outcome.py``).
2. Every rank writes its files into the staging directory, each atomically (``atomic.py``),
   checksummed while written ([Note: checkpoint checksum] in ``integrity.py``), and lists
   their records in its own manifest ``.records_<rank>.json``.
3. ``commit``: agreement; rank 0 merges the manifests into the root record's ``files`` (a file
   written by two ranks must have the same record: replicas may both write it), writes the root record sealed ([Note: sealed metadata] in
   ``metadata.py``), fsyncs, renames the staging directory to the tag ([Note: replacing a
   tag]) and only then replaces ``latest``; agreement.

A crash (kill -9 of any rank) before the last rename leaves the previous tag and ``latest``
as they were; the staging directory is emptied by the next save of that tag. Loading
(:func:`open_tag`) validates the tag given or named by ``latest``, reads the sealed root
record, and every file is verified against the record before it is used
(:func:`read_tensors`), so a file of another step, a flipped bit or a truncated file is an
error naming the file.

[Note: replacing a tag]
Saving under a tag that already exists must not open a window in which ``latest`` names no
loadable checkpoint. Rank 0 commits in three renames, each atomic: the complete new tag is
first finished in ``.<tag>.partial``; the old tag directory is renamed to ``.<tag>.old``; the
staging directory is renamed to ``<tag>``; only then is ``.<tag>.old`` deleted. A crash
between the first two renames leaves ``<tag>`` missing but ``.<tag>.old`` complete, and every
reader (``loader.tag_directory`` and the standalone ``zero_to_fp32.py``) falls back to it; the
next save of the tag finds no ``<tag>`` and simply renames its staging directory into place.
``ZERO_CHECKPOINT_KILL_AT=between_renames`` (a test hook) SIGKILLs rank 0 at that point.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Mapping
from typing import Any

import torch

from zero_core import comm
from zero_core.checkpoint import outcome
from zero_core.checkpoint.atomic import atomic_write_bytes, fsync_dir
from zero_core.checkpoint.format import (
    LATEST_FILE,
    CheckpointError,
    dumps,
    read_json,
    staging_dir_name,
    validate_tag,
)
from zero_core.checkpoint.integrity import verify_file
from zero_core.checkpoint.metadata import read_sealed, sealed_bytes
from zero_core.checkpoint.outcome import attempt
from zero_core.checkpoint.tensor_file import TensorEntry, TensorFile, write_tensor_file

_KILL_AT_ENV = "ZERO_CHECKPOINT_KILL_AT"
_MANIFEST = ".records_{:05d}.json"


def _dist(group: Any) -> tuple[int, int]:
    if not comm.is_initialized():
        return 0, 1
    return comm.get_rank(group), comm.get_world_size(group)


_KEPT = "Nothing was committed: the previous checkpoint and 'latest' are unchanged"


def publish_tag(save_dir: str, stage_dir: str, tag: str, save_latest: bool) -> None:
    """Rename the complete ``stage_dir`` to ``save_dir/tag``, then replace ``latest`` (rank 0 only).

    See [Note: replacing a tag].
    """
    fsync_dir(stage_dir)
    final = os.path.join(save_dir, tag)
    old = os.path.join(save_dir, f".{tag}.old")
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)  # a stale copy: <tag> itself is complete
        os.rename(final, old)
        fsync_dir(save_dir)
        if os.environ.get(_KILL_AT_ENV) == "between_renames":
            os.kill(os.getpid(), signal.SIGKILL)
    os.rename(stage_dir, final)
    fsync_dir(save_dir)
    shutil.rmtree(old, ignore_errors=True)
    if save_latest:
        atomic_write_bytes(os.path.join(save_dir, LATEST_FILE), tag.encode())


class StagedSave:
    """One tag being written by every rank of ``group``; see [Note: one checkpoint writer].

    Collective: every rank constructs it, calls :meth:`begin`, writes its own files and calls
    :meth:`commit`. A write that fails (a full disk) is not raised at once: the rank remembers it
    (its temporary file removed, later writes skipped) and :meth:`commit` raises it on every rank
    (see [Note: collective save outcome]); rank 0 then removes the staging directory.
    """

    def __init__(self, save_dir: str | os.PathLike[str], tag: Any, *, group: Any = None) -> None:
        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"save_checkpoint: save_dir must be a path, got {type(save_dir).__name__}")
        self.save_dir = os.fspath(save_dir)
        self.tag = validate_tag(tag)
        self.group = group
        self.rank, self.world = _dist(group)
        self.stage_dir = os.path.join(self.save_dir, staging_dir_name(self.tag))
        self.records: dict[str, dict[str, Any]] = {}
        self.error: BaseException | None = None  # the first failed write of this rank
        self._what = f"save_checkpoint of tag {self.tag!r} in {self.save_dir}"

    def begin(self) -> None:
        error = attempt(self._prepare) if self.rank == 0 else None
        outcome.agree(self.group, error, f"{self._what}, preparing the staging directory", _KEPT)

    def _prepare(self) -> None:
        os.makedirs(self.save_dir, exist_ok=True)
        shutil.rmtree(self.stage_dir, ignore_errors=True)  # leftovers of a crashed save of this tag
        os.makedirs(self.stage_dir)

    def _path(self, name: str) -> str:
        if not name or os.path.basename(name) != name or name.startswith("."):
            raise ValueError(f"checkpoint file names are plain names not starting with '.', got {name!r}")
        if name in self.records:
            raise CheckpointError(f"checkpoint file {name} of tag {self.tag!r} is written twice by this rank")
        return os.path.join(self.stage_dir, name)

    def write_tensors(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write ``tensors`` (any device; copied to CPU one at a time) as the safetensors file ``name``."""
        entries = [
            TensorEntry(k, tuple(t.shape), t.dtype, (lambda t=t: t.detach())) for k, t in tensors.items()
        ]
        path = self._path(name)
        if self.error is None:
            self.error = attempt(lambda: self.records.__setitem__(name, write_tensor_file(path, entries)))

    def write_json(self, name: str, value: Any) -> None:
        """Write the JSON-compatible ``value`` as the file ``name``."""
        path = self._path(name)
        if self.error is None:
            self.error = attempt(
                lambda: self.records.__setitem__(name, atomic_write_bytes(path, dumps(value), sync_dir=False))
            )

    def _merged_records(self) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = {}
        for r in range(self.world):
            path = os.path.join(self.stage_dir, _MANIFEST.format(r))
            for name, rec in read_json(path).items():
                if files.setdefault(name, rec) != rec:  # replicas may write the same bytes; never others
                    raise CheckpointError(
                        f"checkpoint file {name} of tag {self.tag!r} was written by two ranks with different "
                        "contents"
                    )
            os.unlink(path)
        return files

    def commit(self, record_name: str, meta: dict[str, Any], save_latest: bool = True) -> str:
        """Publish the tag with the root record ``record_name`` (``meta`` plus every file's record).

        ``meta`` is used on rank 0 only. Returns the tag directory. Raises on every rank when a
        write failed on any (see [Note: collective save outcome]).
        """
        manifest = os.path.join(self.stage_dir, _MANIFEST.format(self.rank))
        if self.error is None:
            self.error = attempt(lambda: atomic_write_bytes(manifest, dumps(self.records)))
        self._agree(self.error, "writing the files")

        def publish() -> None:
            merged = {**meta, "tag": self.tag, "files": self._merged_records()}
            atomic_write_bytes(
                os.path.join(self.stage_dir, record_name), sealed_bytes(merged), sync_dir=False
            )
            publish_tag(self.save_dir, self.stage_dir, self.tag, save_latest)

        self._agree(attempt(publish) if self.rank == 0 else None, "committing")
        return os.path.join(self.save_dir, self.tag)

    def _agree(self, error: BaseException | None, step: str) -> None:
        try:
            outcome.agree(self.group, error, f"{self._what}, {step}", _KEPT)
        except BaseException as exc:
            if outcome.all_done_writing(exc, error):
                self.abort()
            raise

    def abort(self) -> None:
        """After a failed save: rank 0 removes the staging directory (a crash leaves it to the next save)."""
        if self.rank == 0:
            shutil.rmtree(self.stage_dir, ignore_errors=True)


def open_tag(load_dir: str | os.PathLike[str], tag: Any, record_name: str) -> tuple[str, dict[str, Any]]:
    """``(tag directory, sealed root record)`` of ``tag``, or of the tag ``latest`` names when None.

    The tag is validated (``..`` or a path is refused, as is a ``latest`` naming one), the root
    record's seal checked. Raises :class:`CheckpointError` naming what is missing or wrong.
    """
    from zero_core.checkpoint.loader import resolve_tag, tag_directory

    if not isinstance(load_dir, (str, os.PathLike)):
        raise TypeError(f"load_checkpoint: load_dir must be a path, got {type(load_dir).__name__}")
    load_dir = os.fspath(load_dir)
    name = resolve_tag(load_dir, tag)
    if name is None:
        raise CheckpointError(f"load_checkpoint: no tag given and no 'latest' file in {load_dir}")
    tag_dir = tag_directory(load_dir, name)
    record = os.path.join(tag_dir, record_name)
    if not os.path.isfile(record):
        what = "does not exist" if not os.path.isdir(tag_dir) else f"has no {record_name}"
        raise CheckpointError(f"checkpoint tag directory {tag_dir} {what}: not a complete checkpoint")
    meta = read_sealed(record, required=True)
    if not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{record} lists no files (corrupted record)")
    return tag_dir, meta


def checked_path(tag_dir: str, meta: dict[str, Any], name: str) -> str:
    """The path of the file ``name`` of a tag, after verifying it against its record."""
    rec = meta["files"].get(name)
    if rec is None:
        raise CheckpointError(f"checkpoint {tag_dir} has no file {name} (its record lists none)")
    path = os.path.join(tag_dir, name)
    verify_file(path, rec)
    return path


def read_tensors(tag_dir: str, meta: dict[str, Any], name: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``name`` of a tag, verified (checksum, strict header)."""
    with TensorFile(checked_path(tag_dir, meta, name)) as f:
        return {k: f.read_tensor(k) for k in f.keys()}


def read_json_file(tag_dir: str, meta: dict[str, Any], name: str) -> Any:
    """The JSON file ``name`` of a tag, verified against its record."""
    return read_json(checked_path(tag_dir, meta, name))


def files_matching(tag_dir: str, meta: dict[str, Any], pattern: str) -> list[str]:
    """Names of the recorded files of a tag matching the glob ``pattern``, sorted."""
    import fnmatch

    return sorted(n for n in meta["files"] if fnmatch.fnmatch(n, pattern))


__all__ = ["StagedSave", "checked_path", "files_matching", "open_tag", "publish_tag", "read_tensors"]
