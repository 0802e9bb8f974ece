"""What every benchmark's results file records about where it ran: the CPU model and the code's commit.

Benchmarks run as scripts (``python tools/bench/bench_x.py``), so their own directory is on
``sys.path`` and ``import bench_env`` finds this module.
"""

from __future__ import annotations

import os
import platform
import subprocess

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
