"""A failing job's error printed once, not once per rank.

[Note: errors printed once]
Every rank of a job usually hits the same error (a missing file, a bad config key). With each
rank printing its traceback, N copies interleave on the terminal, then torchrun adds a summary
box naming the program it started (our ``--local_rank`` shim, not the user's script). So
``zero run`` hands its ranks a folder in ``ZERO_RUN_ERROR_DIR``, and a rank whose script fails
claims the folder's ``first`` file with an atomic ``os.link``: the first rank to fail prints its
error, and a later rank prints its own only when it differs (by type and message) from the
first one. The traceback starts at the user's script (the shim's and runpy's frames are
dropped), and a ``SystemExit("message")`` prints as its message alone, as Python itself does.
The launcher then says in one line which ranks of which script failed and exits with the
status of the rank that failed first (see ``zero_core.launcher.run.failed_first``): each rank
leaves an ``exit-<rank>.json`` note with its status and whether it only followed a failed peer
(see [Note: failed ranks]), whose error then prints as one line, not a traceback. A script started another way (torchrun or python directly,
no folder) raises as usual. With several nodes, each node's launcher has its own folder, so an
error common to all ranks prints once per node.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ERROR_DIR_ENV = "ZERO_RUN_ERROR_DIR"
#: frames of these files are the launcher's, not the user's: left out of a rank's traceback
_LAUNCHER_FILES = ("runpy.py", "<frozen runpy>", "local_rank_arg.py", "rank_errors.py")


def _rank() -> str:
    return (
        os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
    )


def _user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` from the first frame outside the launcher's own files."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    keep = 0
    while keep < len(frames) and os.path.basename(frames[keep].filename) in _LAUNCHER_FILES:
        keep += 1
    te.stack = traceback.StackSummary.from_list(frames[keep:] or frames)
    return "".join(te.format())


def _claim_first(folder: Path, key: str) -> str | None:
    """Record ``key`` as the job's first error; returns the earlier key when another rank was first."""
    mine = folder / f"rank-{os.getpid()}"
    mine.write_text(key)
    try:
        os.link(mine, folder / "first")  # atomic: exactly one rank succeeds
        return None
    except FileExistsError:
        return (folder / "first").read_text()
    finally:
        mine.unlink(missing_ok=True)


def report(folder: Path, text: str, key: str) -> None:
    """Print ``text`` to stderr unless another rank already printed an error with the same ``key``."""
    earlier = _claim_first(folder, key)
    if earlier is None or earlier != key:
        print(f"[rank {_rank()}] {text.rstrip()}", file=sys.stderr, flush=True)


def _status(code: object) -> int:
    """The exit status ``SystemExit(code)`` gives: None is 0, an int itself, anything else 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _record(what: str, *args: Any) -> None:
    """Record this rank's failure in the job's store (``failures.<what>(*args)``, see [Note:
    failed ranks]), if it has one."""
    if "torch.distributed" not in sys.modules:
        return  # failed before torch was imported: no process group, nothing to tell
    try:
        from zero_core.comm import failures

        getattr(failures, what)(*args)
    except Exception:
        pass


def note_exit(folder: Path | None, code: int, followed: bool) -> None:
    """Tell ``zero run`` how this rank ends: its status and whether it only followed a failed peer."""
    if folder is None:
        return
    note = {"code": code, "followed": followed, "time": time.time()}
    with contextlib.suppress(OSError):
        (folder / f"exit-{_rank()}.json").write_text(json.dumps(note))


def read_exit_notes(folder: str | Path) -> dict[int, dict[str, Any]]:
    """The notes of :func:`note_exit`, by rank."""
    out: dict[int, dict[str, Any]] = {}
    for path in Path(folder).glob("exit-*.json"):
        rank = path.stem.split("-", 1)[1]
        with contextlib.suppress(OSError, ValueError):
            if rank.isdigit():
                out[int(rank)] = json.loads(path.read_text())
    return out


def run_reporting_once(run: Callable[[], object]) -> None:
    """Call ``run`` (a rank's script). A failure (an exception, ``sys.exit(n)`` with ``n != 0``,
    Ctrl-C) is recorded for the peers (see [Note: failed ranks]); under ``zero run`` the error
    is reported once and the rank exits 1 (``sys.exit(n)`` keeps its status). An error that
    only follows a failed peer (``PeerFailedError``) prints as one line: the traceback that
    matters is the failed rank's."""
    folder = os.environ.get(ERROR_DIR_ENV)
    where = Path(folder) if folder and os.path.isdir(folder) else None
    try:
        run()
    except SystemExit as exc:
        status = _status(exc.code)
        if status:
            _record("record_exit", status, exc)
            note_exit(where, status, followed=False)
        if where is not None and not (exc.code is None or isinstance(exc.code, int)):
            report(where, str(exc.code), f"SystemExit: {exc.code}")
            raise SystemExit(1) from None
        raise
    except KeyboardInterrupt as exc:
        _record("record_exception", exc, 130)
        raise
    except Exception as exc:
        _record("record_exception", exc)
        if where is None:
            raise
        followed = isinstance(getattr(exc, "failed_rank", None), int)
        note_exit(where, 1, followed)
        text = f"{type(exc).__name__}: {exc}" if followed else _user_traceback(exc)
        report(where, text, f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
