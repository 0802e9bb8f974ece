"""Run a training script with ``--local_rank=N`` before its own arguments, as DeepSpeed's launcher does.

torchrun hands a process its local rank only through the environment (LOCAL_RANK); DeepSpeed's
launcher also passes ``--local_rank=N`` on the command line, and DeepSpeed scripts read
``args.local_rank`` (often with a default of -1 that means "not distributed"). ``zero run``
therefore starts every rank as ``python -m zero_core.launcher.local_rank_arg SCRIPT ARGS...``
(with ``--no-local-rank`` when ``zero run`` was given ``--no_local_rank``, DeepSpeed's flag of
the same name: the script's arguments are then passed unchanged). Every rank's script runs
through :func:`zero_core.launcher.rank_errors.run_reporting_once`, so that an error common to
the ranks prints once (see [Note: errors printed once]).

    python -m zero_core.launcher.local_rank_arg [--no-local-rank] [--module] SCRIPT_OR_MODULE [ARGS...]
"""

from __future__ import annotations

import os
import runpy
import sys

from zero_core.distributed.world_info import discover_world
from zero_core.launcher.rank_errors import run_reporting_once

USAGE = "usage: python -m zero_core.launcher.local_rank_arg [--no-local-rank] [--module] SCRIPT_OR_MODULE [ARGS...]"


def script_argv(target: str, args: list[str], local_rank: int) -> list[str]:
    """``sys.argv`` for the script: DeepSpeed's order, the local rank before the script's arguments."""
    return [target, f"--local_rank={local_rank}", *args]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    pass_local_rank = not (bool(argv) and argv[0] == "--no-local-rank")
    if not pass_local_rank:
        argv = argv[1:]
    module = bool(argv) and argv[0] == "--module"
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit(USAGE)
    target, args = argv[0], argv[1:]
    if pass_local_rank:
        sys.argv = script_argv(target, args, discover_world().local_rank)
    else:
        sys.argv = [target, *args]
    if module:
        run_reporting_once(lambda: runpy.run_module(target, run_name="__main__", alter_sys=True))
        return
    # `python script.py` puts the script's directory first on sys.path (for its sibling imports);
    # `python -m this_module` put the working directory there instead.
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    run_reporting_once(lambda: runpy.run_path(target, run_name="__main__"))


if __name__ == "__main__":
    main()
