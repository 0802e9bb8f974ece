"""What every benchmark's results file records about where it ran: the CPU model and the code's commit.

Benchmarks run as scripts (``python tools/bench/bench_x.py``), so their own directory is on
``sys.path`` and ``import bench_env`` finds this module.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import socket
import subprocess
from collections.abc import Callable
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def cpu_model() -> str:
    """The ``model name`` of /proc/cpuinfo (``platform.processor()`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit(*paths: str) -> str:
    """HEAD's hash, marked when the working tree differs from it under ``paths`` (the whole tree if none).

    A results file must say which code it measured: a run with uncommitted edits to the measured code
    reads "<hash> (with uncommitted changes to <paths>)". Outside a git checkout: "unknown commit".
    """
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            # results files are what a run writes, not the code it measured
            ["git", "status", "--porcelain", "--", *(paths or (".",)), ":(exclude)tools/bench/results"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    if dirty:
        head += f" (with uncommitted changes to {', '.join(paths) if paths else 'the working tree'})"
    return head


def _rank_main(
    fn: Callable[..., Any], args: tuple, rank: int, world: int, per_node: int, port: int, q
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % per_node),
    )
    if per_node != world:  # local processes standing for several nodes (zero_core's topology reads it)
        os.environ["ZERO_RANKS_PER_NODE"] = str(per_node)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q.put((rank, fn(*args)))
    except BaseException as exc:  # report, do not hang the parent
        q.put((rank, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


def fork_ranks(
    fn: Callable[..., dict], args: tuple, world: int, *, per_node: int | None = None, timeout: float = 3600.0
) -> list[dict]:
    """Run ``fn(*args)`` on ``world`` forked gloo ranks; their results (dicts) in rank order.

    Needs no zero_core (the benchmarks run it in DeepSpeed's environment too). ``per_node`` ranks
    per node (default: all on one) sets ``LOCAL_RANK`` and ``ZERO_RANKS_PER_NODE``, so one machine
    can stand for several nodes. A rank that fails kills the others and raises with its error.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    per_node = per_node or world
    procs = [
        ctx.Process(target=_rank_main, args=(fn, args, r, world, per_node, port, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    for _ in procs:
        rank, res = q.get(timeout=timeout)
        if not isinstance(res, dict):
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} of {args} failed: {res}")
        out[rank] = res
    for p in procs:
        p.join()
    return [out[r] for r in range(world)]
