"""``zero run``: start a job through torchrun or ``mpiexec``.

No process management of our own: the torch launcher is ``torch.distributed.run.main``
(elastic agent, restarts, rendezvous), the MPI launcher is the MPI distribution's ``mpiexec``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

# (our option dest, torchrun flag) for the flags passed through to torchrun unchanged.
TORCHRUN_FLAGS = (
    ("nnodes", "--nnodes"),
    ("node_rank", "--node-rank"),
    ("master_addr", "--master-addr"),
    ("master_port", "--master-port"),
    ("rdzv_backend", "--rdzv-backend"),
    ("rdzv_endpoint", "--rdzv-endpoint"),
    ("rdzv_id", "--rdzv-id"),
    ("max_restarts", "--max-restarts"),
)


class LaunchError(RuntimeError):
    """The job could not be started (bad arguments, missing launcher)."""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launcher",
        choices=("torch", "mpi"),
        default="torch",
        help="torch: torchrun (torch.distributed.run), the default; mpi: mpiexec from the MPI "
        "distribution next to this Python (pip install mpich mpi4py) or on PATH",
    )
    parser.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        "-n",
        dest="nproc",
        type=int,
        default=None,
        help="processes to start (per node with torchrun; in total with mpiexec). Default: 1",
    )
    g = parser.add_argument_group("torchrun options (multi-node and elastic; --launcher torch only)")
    g.add_argument("--nnodes", default=None, help="number of nodes, or MIN:MAX for elastic jobs")
    g.add_argument(
        "--node-rank", "--node_rank", dest="node_rank", type=int, default=None, help="rank of this node"
    )
    g.add_argument(
        "--master-addr", "--master_addr", dest="master_addr", default=None, help="address of node 0"
    )
    g.add_argument(
        "--master-port", "--master_port", dest="master_port", type=int, default=None, help="port on node 0"
    )
    g.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        default=None,
        help="rendezvous backend (c10d, static, etcd)",
    )
    g.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None, help="rendezvous HOST:PORT"
    )
    g.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None, help="job id shared by all nodes")
    g.add_argument("--standalone", action="store_true", help="single node, local rendezvous on a free port")
    g.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=None,
        help="restarts on failure",
    )
    m = parser.add_argument_group("mpiexec options (--launcher mpi only)")
    m.add_argument(
        "--mpi-args",
        dest="mpi_args",
        default="",
        help="extra arguments for mpiexec, one string; use the = form: --mpi-args='-f hosts'",
    )
    parser.add_argument(
        "--no_local_rank",
        "--no-local-rank",
        dest="no_local_rank",
        action="store_true",
        help="do not pass --local_rank=N to the script (passed by default, as DeepSpeed's launcher does; "
        "the local rank is also in the environment, LOCAL_RANK with torchrun)",
    )
    parser.add_argument(
        "--autotuning",
        choices=("tune", "run"),
        default=None,
        help="search for the fastest config that fits (the config's 'autotuning' section): tune writes "
        "the results (autotuning_results/ds_config_optimal.json, summary.md); run also launches the job "
        "with the best config. The script must take its config as --zero_config/--deepspeed_config PATH. "
        "The autotuner is zero-profiler's (its autotuning extra)",
    )
    parser.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    parser.add_argument("script", help="training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


#: the script's flags that name a config file (DeepSpeed's and ours), checked before any rank starts
CONFIG_FLAGS = ("--zero_config", "--deepspeed_config", "--deepspeed")


def config_paths(script_args: list[str]) -> list[tuple[str, str]]:
    """(flag, path) for every config file the script's arguments name (the last of a repeated
    flag, which is the one argparse keeps).

    ``--deepspeed`` is a boolean flag in DeepSpeed's own parser and a path in HF's: it counts as
    a path only when its value ends in ``.json``. JSON text (``{...}``) is not a path.
    """
    found: dict[str, str] = {}
    for i, arg in enumerate(script_args):
        flag, eq, value = arg.partition("=")
        if flag not in CONFIG_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(script_args) or script_args[i + 1].startswith("-"):
                continue
            value = script_args[i + 1]
        if value.lstrip().startswith("{") or (flag == "--deepspeed" and not value.endswith(".json")):
            continue
        found[flag] = value
    return list(found.items())


def check_job(args: argparse.Namespace) -> None:
    """Checks that need no rank: they fail here, once, before torchrun or mpiexec starts any."""
    if args.nproc is not None and args.nproc < 1:
        raise LaunchError(f"zero run: --nproc must be >= 1, got {args.nproc}")
    if not args.module and not Path(args.script).is_file():
        raise LaunchError(
            f"zero run: script {args.script!r} does not exist (relative to {os.getcwd()}; use -m to run "
            "a module); no process was started"
        )
    for flag, path in config_paths(args.script_args):
        if not Path(path).is_file():
            raise LaunchError(
                f"zero run: {flag} {path!r} (an argument of {args.script}) is not a file "
                f"(relative to {os.getcwd()}); no process was started"
            )


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The argument list for ``torch.distributed.run.main``."""
    check_job(args)
    argv = ["--nproc-per-node", str(args.nproc or 1)]
    for dest, flag in TORCHRUN_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            argv += [flag, str(value)]
    rendezvous_given = any(
        getattr(args, d) is not None for d in ("master_addr", "master_port", "rdzv_backend", "rdzv_endpoint")
    )
    if args.standalone or (str(args.nnodes or "1") in ("1", "1:1") and not rendezvous_given):
        # A single-node job without rendezvous flags: torchrun's default would be a static
        # rendezvous on 127.0.0.1:29500, which collides with any other job on the machine;
        # --standalone picks a free port instead.
        argv.append("--standalone")
    return [*argv, *_program(args, for_torchrun=True)]


#: the module that inserts --local_rank=N into the script's arguments (see its docstring)
LOCAL_RANK_SHIM = "zero_core.launcher.local_rank_arg"


def _program(args: argparse.Namespace, for_torchrun: bool) -> list[str]:
    """What each rank runs: the script (or module) and its arguments, through the shim that adds
    --local_rank (unless --no_local_rank) and prints an error common to the ranks once (see
    [Note: errors printed once]). torchrun takes ``--module NAME`` for ``python -m NAME``."""
    module_flag = "--module" if for_torchrun else "-m"
    return [
        module_flag,
        LOCAL_RANK_SHIM,
        *(["--no-local-rank"] if args.no_local_rank else []),
        *(["--module"] if args.module else []),
        args.script,
        *args.script_args,
    ]


def find_mpiexec() -> str:
    """``mpiexec`` next to ``sys.executable`` (a venv with the mpich wheel), else on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    raise LaunchError(
        "zero run --launcher mpi: no mpiexec found next to the Python interpreter "
        f"({Path(sys.executable).parent}) or on PATH; install one with: pip install mpich mpi4py"
    )


def _mpi_flavour(mpiexec: str) -> str:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "openrte" in text or "prte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "hydra"
    return "unknown"


def mpiexec_command(args: argparse.Namespace, env: dict[str, str]) -> list[str]:
    """The ``mpiexec`` command line; sets OMP_NUM_THREADS in ``env`` (default 1, as torchrun)."""
    check_job(args)
    given = [flag for dest, flag in TORCHRUN_FLAGS if getattr(args, dest) is not None]
    if args.standalone:
        given.append("--standalone")
    if given:
        raise LaunchError(
            f"zero run --launcher mpi: {', '.join(given)} are torchrun options; give mpiexec its host "
            "list through --mpi-args (e.g. --mpi-args='-f hostfile')"
        )
    import shlex

    mpiexec = find_mpiexec()
    threads = env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [mpiexec, "-n", str(args.nproc or 1)]
    flavour = _mpi_flavour(mpiexec)
    # Forward OMP_NUM_THREADS to every node, not just the local one.
    if flavour == "hydra":
        cmd += ["-genv", "OMP_NUM_THREADS", threads]
    elif flavour == "openmpi":
        cmd += ["-x", f"OMP_NUM_THREADS={threads}"]
    cmd += shlex.split(args.mpi_args)
    cmd += [sys.executable, *_program(args, for_torchrun=False)]
    return cmd


def run_job(args: argparse.Namespace) -> int:
    """Start the job described by the ``zero run`` arguments; returns its exit code.

    The launch only: ``zero run --autotuning`` goes to the autotuner (``cli.run_command``),
    which launches its experiments, and then the job, through here."""
    import tempfile

    from zero_core.launcher.rank_errors import ERROR_DIR_ENV

    with tempfile.TemporaryDirectory(prefix="zero-run-") as errors:  # See [Note: errors printed once]
        if args.launcher == "mpi":
            env = {**os.environ, ERROR_DIR_ENV: errors}
            cmd = mpiexec_command(args, env)
            proc = subprocess.Popen(cmd, env=env)
            try:
                code = proc.wait()
            except KeyboardInterrupt:  # mpiexec got the same SIGINT; let it shut the ranks down
                code = proc.wait()
            if code:
                print(f"zero run: {args.script} failed (mpiexec exit code {code})", file=sys.stderr)
            return code
        argv = torchrun_argv(args)
        return _run_torchrun(argv, args.script, errors)


def failure_summary(script: str, failures: dict, notes: dict[int, dict] | None = None) -> str:
    """One line: which ranks of ``script`` failed, and which stopped because of them.

    ``failures`` maps a global rank to torchrun's record of it (``exitcode``; negative when
    the process was ended by a signal, as torchrun ends the others once one rank fails);
    ``notes`` are the ranks' exit notes (a rank that only followed a failed peer says so).
    """
    notes = notes or {}

    def ranks(rs: list[int]) -> str:
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(str(r) for r in rs)}"

    def how(rs: list[int]) -> str:
        codes = sorted({failures[r].exitcode for r in rs})
        return ", ".join(f"exit code {c}" if c >= 0 else f"killed by {_signal_name(-c)}" for c in codes)

    first, _ = failed_first(failures, notes)
    followed = sorted(r for r in failures if r != first and notes.get(r, {}).get("followed"))
    stopped = sorted(
        r for r in failures if r != first and r not in notes and failures[r].exitcode == -signal.SIGTERM
    )
    failed = sorted(set(failures) - set(followed) - set(stopped))
    line = f"{script} failed on {ranks(failed)} ({how(failed)})"
    if followed:
        line += f"; {ranks(followed)} stopped because of it"
    return line + (f"; {ranks(stopped)} stopped by the launcher" if stopped else "")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def failed_first(failures: dict, notes: dict[int, dict]) -> tuple[int, int]:
    """``(rank, exit status)`` of the rank that failed first, which ``zero run`` exits with.

    ``failures``: torchrun's record per global rank (``exitcode``, negative for a signal, and
    ``timestamp``, in whole seconds; the mapping lists the ranks in the order torchrun saw them
    end, which breaks ties); ``notes``: the ranks' own exit notes (see [Note: errors printed
    once]). A rank that only followed a failed peer, or ended by the SIGTERM torchrun sends the
    others once one rank failed, is chosen only when no rank failed on its own. A signal is
    reported as ``128 + signal``, as a shell does.
    """

    seen = {r: i for i, r in enumerate(failures)}  # torchrun records the ranks in the order it saw them end

    def order(r: int) -> tuple[int, float, int]:
        note, code = notes.get(r), failures[r].exitcode
        if note is not None:
            return (2 if note.get("followed") else 0, float(note.get("time", 0.0)), seen[r])
        stopped = code == -signal.SIGTERM  # torchrun's stop, unless nothing else failed
        return (1 if stopped else 0, float(failures[r].timestamp or 0), seen[r])

    rank = min(failures, key=order)
    code = notes.get(rank, {}).get("code", failures[rank].exitcode)
    code = int(code) if isinstance(code, int) else 1
    return rank, (128 - code if code < 0 else code) or 1


def _run_torchrun(argv: list[str], script: str, errors: str) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from zero_core.launcher.rank_errors import ERROR_DIR_ENV

    saved = {k: os.environ.get(k) for k in (ERROR_DIR_ENV, "OMP_NUM_THREADS")}
    os.environ[ERROR_DIR_ENV] = errors
    # torchrun sets OMP_NUM_THREADS=1 itself when it is unset, with a banner saying so; we set
    # the same default (documented in `zero run --help`), so the banner has nothing to say.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Its per-rank "failed (exitcode ...) of binary: python" and "closing signal" lines repeat,
    # less clearly, what failure_summary prints.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        # The ranks printed the error (once); torchrun's own summary would name our shim.
        from zero_core.launcher.rank_errors import read_exit_notes

        notes = read_exit_notes(errors)
        _, code = failed_first(exc.failures, notes)
        print(f"zero run: {failure_summary(script, exc.failures, notes)}", file=sys.stderr)
        return code
    finally:
        agent_log.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0
