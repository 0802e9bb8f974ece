"""Entry point of the ``zero`` console script."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from zero_core import plugins
from zero_core.launcher.env_report import collect_report, format_report
from zero_core.launcher.run import LaunchError, add_run_arguments, check_job, run_job
from zero_core.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero",
        description="zero: launch ZeRO training jobs and inspect the installation.",
        epilog="Examples:\n"
        "  zero run --nproc 2 train.py --zero_config cfg.json   # 2 processes via torchrun\n"
        "  zero run --launcher mpi -n 4 train.py                # 4 processes via mpiexec\n"
        "  zero run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 --nproc 8 train.py\n"
        "  zero run --autotuning run --nproc 2 train.py --zero_config cfg.json  # tune, then train\n"
        "  zero env                                             # versions, ops, backends",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"zero-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="launch a training script on N processes (torchrun or mpiexec)",
        description="Launch SCRIPT on N processes. With --launcher torch (default) this is torchrun "
        "(torch.distributed.run) and accepts its multi-node flags; with --launcher mpi it runs "
        "`mpiexec -n N python SCRIPT ARGS`. Each process should call zero.init_distributed() (or "
        "zero.initialize), which reads the world from the launcher's environment. OMP_NUM_THREADS "
        "defaults to 1 per process.",
    )
    add_run_arguments(run)
    env = sub.add_parser(
        "env",
        help="report versions, installed packages, native ops and backends",
        description="Report versions, installed zero packages, native-op status, the "
        "accelerator, distributed backends and MPI availability.",
    )
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def run_command(args: argparse.Namespace) -> int:
    """``zero run``: the job, or with ``--autotuning`` the autotuner, which launches its
    experiments (and, with ``run``, then the job) through :func:`run_job`; returns the exit code."""
    if not args.autotuning:
        return run_job(args)
    check_job(args)
    try:  # the autotuner is zero-profiler's (its autotuning extra)
        autotuner = plugins.require(
            "zero_profiler.autotuning.autotuner", "zero run --autotuning", extra="autotuning"
        )
    except plugins.MissingPackageError as exc:
        raise LaunchError(str(exc)) from None
    try:
        return autotuner.autotune(args)
    except autotuner.AutotuningError as exc:
        raise LaunchError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zero`` command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "env":
        report = collect_report()
        print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
        return 0
    try:
        code = run_command(args)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if argv is None and code != 0:
        _end_now(code)
    return code


def _end_now(code: int) -> None:
    """End the ``zero`` process of a failed job at once: the ranks have ended, the agent has shut
    down, nothing of the launcher's needs the interpreter's teardown (seconds, with torch
    imported, on a loaded machine: time a failed job would otherwise still take)."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
