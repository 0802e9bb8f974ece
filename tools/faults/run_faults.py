"""Fault injection (issues 25 and 37): run the cases, print the table and the totals.

    python tools/faults/run_faults.py            # small mode (a few minutes)
    python tools/faults/run_faults.py --full     # by hand: every row (about an hour on 2 loaded cores)
    python tools/faults/run_faults.py --full --out tools/bench/results/faults.md
    python tools/faults/run_faults.py --only rank_failures,one_sided   # some case functions
    python tools/faults/run_faults.py --full --sample   # rank failures: a 40-job slice of the matrix

Cases live next to this file: ``runtime_cases.py`` (mismatched, stalled, exiting ranks, SIGTERM),
``rank_failure_cases.py`` (one rank fails a given way in forward/backward/step at every stage,
offload and pipeline, 2 and 4 ranks: the job must end within 15 s of the fault), ``failfast_cases.py``
(saves and loads failing or called on one rank, a user's timeout, a rank ending mid-save, corrupted
swap files) and ``checkpoint_cases.py`` (kills during saves, corruptions, forged files). A case module
offers ``cases(full)`` returning rows, or ``CASES`` (functions), or functions named ``case_*``;
a function returns one row ``(case, expected, observed, verdict)`` or a list of them. The exit
status is 1 when any verdict is not ``ok``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODULES = ("runtime_cases", "rank_failure_cases", "failfast_cases", "checkpoint_cases")
Row = tuple[str, str, str, str]


def _load(name: str) -> Any | None:
    path = HERE / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"zero_faults_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _functions(module: Any) -> list[Callable[..., Any]]:
    if hasattr(module, "CASES"):
        return list(module.CASES)
    return [
        getattr(module, n)
        for n in sorted(dir(module))
        if n.startswith("case_") and callable(getattr(module, n))
    ]


def _call(fn: Callable[..., Any], full: bool, sample: bool = False) -> list[Row]:
    try:
        params = inspect.signature(fn).parameters
        kwargs: dict[str, Any] = {"full": full} if "full" in params else {}
        if sample and "sample" in params:
            kwargs["sample"] = True
        out = fn(**kwargs)
    except Exception as exc:  # a case that crashes is a failed case, not a crashed run
        return [
            (getattr(fn, "__name__", "case"), "runs", f"crashed: {type(exc).__name__}: {exc}"[:230], "FAIL")
        ]
    if isinstance(out, tuple):
        return [out]
    return [tuple(r) for r in out]


def collect(full: bool, only: str = "", sample: bool = False) -> list[Row]:
    rows: list[Row] = []
    for name in MODULES:
        module = _load(name)
        if module is None:
            continue
        if hasattr(module, "cases") and not only and not sample:
            rows += [tuple(r) for r in module.cases(full)]
            continue
        for fn in _functions(module):
            if only and not any(part and part in fn.__name__ for part in only.split(",")):
                continue
            start = time.monotonic()
            print(f"{name}.{fn.__name__} ...", file=sys.stderr, flush=True)
            got = _call(fn, full, sample)
            print(
                f"  {fn.__name__}: {len(got)} row(s) in {time.monotonic() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            rows += got
    return rows


def totals(rows: list[Row]) -> list[str]:
    def count(prefix: str) -> tuple[int, int]:
        mine = [r for r in rows if r[0].startswith(prefix)]
        return len(mine), sum(r[3] == "ok" for r in mine)

    lines = []
    n, ok = count("mismatch")
    s, s_ok = count("save_checkpoint")
    t, t_ok = count("different tags")
    lines.append(
        f"{n + s + t} mismatches, {ok + s_ok + t_ok} named (or handled per tag_validation) within the timeout"
    )
    exits = [r for r in rows if r[0].startswith("exit:")]
    runs = sum(int(r[0].split(" x ")[0].split()[-1]) for r in exits)
    aborts = sum(int(r[2].split(" aborts")[0].split()[-1]) for r in exits if " aborts" in r[2])
    lines.append(f"{runs} exits of 4-rank runs, {aborts} aborts")
    n, ok = count("stall")
    lines.append(f"{n} stalls, {ok} named with the collective and the rank, all processes exited")
    n, ok = count("SIGTERM")
    lines.append(f"{n} SIGTERM runs, {ok} left no swap files")
    failing = [r for r in rows if r[0].startswith("rank failure:")]
    if failing:
        times = [float(m.group(1)) for r in failing if (m := re.search(r"ended ([0-9.]+) s after", r[2]))]
        lines.append(
            f"{len(failing)} failing-rank jobs, {sum(r[3] == 'ok' for r in failing)} ok: "
            f"{sum(t <= 15 for t in times)} ended within 15 s of the fault (longest {max(times, default=0):.1f} s, "
            f"median {statistics.median(times) if times else 0:.1f} s), "
            f"{sum('WATCHDOG' in r[2] for r in failing)} needed the watchdog, "
            f"{sum('named by NOBODY' not in r[2] for r in failing)} named the failed rank"
        )
    other = [
        r
        for r in rows
        if not r[0].startswith(
            ("mismatch", "save_checkpoint", "different tags", "exit:", "stall", "SIGTERM", "rank failure:")
        )
    ]
    if other:
        lines.append(
            f"{len(other)} other cases (checkpoints, saves, loads, timeouts, swap files), {sum(r[3] == 'ok' for r in other)} ok"
        )
    bad = [r for r in rows if r[3] != "ok"]
    lines.append(f"TOTAL: {len(rows)} rows, {len(rows) - len(bad)} ok, {len(bad)} failed")
    return lines


def table(rows: list[Row]) -> str:
    def esc(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    out = ["| case | expected | observed | verdict |", "|---|---|---|---|"]
    out += [f"| {esc(a)} | {esc(b)} | {esc(c)} | {esc(d)} |" for a, b, c, d in rows]
    return "\n".join(out)


def _loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def _commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
    ).stdout.strip()


def _header(args: argparse.Namespace, seconds: float, load_at_start: str, commit: str) -> str:
    import torch

    return (
        f"machine: {platform.node()} ({platform.machine()}, {__import__('os').cpu_count()} CPUs), load average "
        f"{load_at_start} at the start, {_loadavg()} at the end (1, 5, 15 min; shared with other jobs)"
        f"\n\ntorch {torch.__version__}, Python {platform.python_version()}, commit {commit}\n\n"
        f"command: python tools/faults/run_faults.py{' --full' if args.full else ''}{' --sample' if args.sample else ''}"
        f"{' --only ' + args.only if args.only else ''}; wall time {seconds:.0f} s\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="the by-hand size (20 clean-exit runs)")
    p.add_argument(
        "--only",
        default="",
        help="run only the case functions whose name contains one of these (comma-separated)",
    )
    p.add_argument(
        "--sample",
        action="store_true",
        help="cases that offer it run a slice of their matrix (rank failures: 40 of the 180 jobs)",
    )
    p.add_argument("--out", default="", help="also write the table as markdown to this file")
    args = p.parse_args(argv)
    start, load_at_start, commit = time.monotonic(), _loadavg(), _commit()  # the code under test: read first
    rows = collect(args.full, args.only, args.sample)
    text = table(rows) + "\n\n" + "\n".join(f"- {line}" for line in totals(rows)) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        body = (
            "# Fault injection (issues 25, 37)\n\n"
            + _header(args, time.monotonic() - start, load_at_start, commit)
            + "\n"
            + text
        )
        Path(args.out).write_text(body)
    return 0 if all(r[3] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
