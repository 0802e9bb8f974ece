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
The launcher then says in one line which ranks of which script failed (see
``zero_core.launcher.run.run_job``). A script started another way (torchrun or python directly,
no folder) raises as usual. With several nodes, each node's launcher has its own folder, so an
error common to all ranks prints once per node.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

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


def run_reporting_once(run: Callable[[], object]) -> None:
    """Call ``run`` (a rank's script); when it fails under ``zero run``, report the error once and exit 1."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        run()
        return
    try:
        run()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            raise
        report(Path(folder), str(exc.code), f"SystemExit: {exc.code}")
        raise SystemExit(1) from None
    except Exception as exc:
        report(Path(folder), _user_traceback(exc), f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
