"""Fault injection for issue 37: one rank fails; the job must end within seconds, naming it.

Each row is one ``zero run`` job of ``tiny_train.py`` in which one rank fails a given way
(``raise``, ``sys.exit(1)``, ``os._exit(1)``, SIGKILL, SIGTERM to itself) at its second step, in
forward, backward or the optimizer step, for ZeRO stages 0-3, stage 2 with the optimizer on
NVMe, and a two-stage pipeline, at 2 and 4 ranks. A row records the time from the fault (the
failing rank prints ``FAULT <unix time>`` just before it) to the end of ``zero run`` (so
interpreter start-up does not count), the job's status, and what the surviving ranks printed.
It is ``ok`` when the job ended with a failure status within ``TARGET_S`` of the fault, no
collective watchdog had to fire (the default 300 s timeout is in force), the failed rank is
named (by a survivor's error, or by ``zero run``'s summary for survivors the launcher stopped
first), and, with NVMe offload, no surviving rank left swap files (a rank ended by SIGKILL or
``os._exit`` cannot clean up: its files are removed by the next job on that folder, see
[Note: swap file lifecycle]).

``case_rank_failures(full=False)``: 6 rows (raise, exit, SIGKILL in backward at stages 2 and 3,
2 ranks); ``full``: the whole matrix (180 rows), two jobs at a time (one for 4-rank jobs), with
a progress line per job on stderr; ``sample`` (``run_faults.py --sample``): 40 rows in which
every kind, phase and configuration occurs at 2 ranks and every kind at 4 ranks.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TINY = HERE / "tiny_train.py"
TARGET_S = 15.0
KINDS = ("raise", "exit", "os_exit", "sigkill", "sigterm-self")
PHASES = ("forward", "backward", "step")
CONFIGS = {
    "stage 0": ["--stage", "0"],
    "stage 1": ["--stage", "1"],
    "stage 2": ["--stage", "2"],
    "stage 3": ["--stage", "3"],
    "stage 2 + NVMe offload": ["--stage", "2", "--nvme"],
    "pipeline (2 stages)": ["--pipeline"],
}
Row = tuple[str, str, str, str]
_WATCHDOG_MARKS = ("did not complete: waited", "collective watchdog fired")
_KIND_TEXT = {
    "exit": "sys.exit(1)",
    "os_exit": "os._exit(1)",
    "sigkill": "SIGKILL",
    "sigterm-self": "SIGTERM",
}


@dataclasses.dataclass(frozen=True)
class Job:
    config: str
    kind: str
    phase: str
    nproc: int

    @property
    def rank(self) -> int:
        return 1 if self.nproc == 2 else 2

    def name(self) -> str:
        return f"{_KIND_TEXT.get(self.kind, self.kind)} in {self.phase}, {self.config}, {self.nproc} ranks"


@dataclasses.dataclass
class Outcome:
    status: int | str
    after_fault: float | None
    output: str
    swap_left: list[str]


def _zero_cli() -> list[str]:
    return [sys.executable, "-c", "import sys; from zero_core.launcher.cli import main; sys.exit(main())"]


def run_job(job: Job, timeout_s: float = 300.0) -> Outcome:
    """Run ``job`` through ``zero run``; the seconds from its fault to the job's end."""
    with tempfile.TemporaryDirectory(prefix="zero-fault-") as nvme:
        args = [a if a != "--nvme" else f"--nvme={nvme}" for a in CONFIGS[job.config]]
        cmd = [*_zero_cli(), "run", "--nproc", str(job.nproc), str(TINY), *args]
        cmd += ["--fault", job.kind, "--phase", job.phase, "--rank-at-fault", str(job.rank), "--steps", "3"]
        env = {k: v for k, v in os.environ.items() if k != "ZERO_JOB_NAME"}
        env["OMP_NUM_THREADS"] = "1"
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
            status, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            status, out = "hung", _text(exc.stdout) + _text(exc.stderr)
        end = time.time()
        left = sorted(str(p.relative_to(nvme)) for p in Path(nvme).rglob("*") if p.is_file())
    fault = re.search(r"^FAULT ([0-9.]+) rank", out, re.M)
    return Outcome(status, end - float(fault.group(1)) if fault else None, out, left)


def _text(data: object) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else str(data or "")


def survivor_lines(out: str, failed: int) -> list[str]:
    """What the ranks other than ``failed`` printed about the failure (their errors, zero's notes)."""
    keep = []
    for line in out.splitlines():
        m = re.match(r"^\[(?:rank ?|zero\] rank )(\d+)\]?\s*(.*)", line)
        if (
            m
            and int(m.group(1)) != failed
            and ("Error" in line or "ending this process" in line or "SIGTERM" in line)
        ):
            keep.append(line.strip())
    return keep


def verdict(job: Job, got: Outcome) -> Row:
    said = survivor_lines(got.output, job.rank)
    summary = next((ln for ln in got.output.splitlines() if ln.startswith("zero run: ")), "")
    named_by = (
        "survivors"
        if any(f"rank {job.rank}" in s for s in said)
        else "launcher"
        if f"failed on rank {job.rank} " in summary
        else ""
    )
    watchdog = any(m in got.output for m in _WATCHDOG_MARKS)
    # a rank ended by SIGKILL or os._exit leaves its own job folder (the next job sweeps it)
    theirs = {p.split("/")[0] for p in got.swap_left if f"/rank{job.rank}/" in p}
    killed_self = job.kind in ("sigkill", "os_exit")
    swap_ok = all(p.split("/")[0] in theirs for p in got.swap_left) if killed_self else not got.swap_left
    fast = got.after_fault is not None and got.after_fault <= TARGET_S
    ok = got.status not in (0, "hung") and fast and bool(named_by) and not watchdog and swap_ok
    when = f"{got.after_fault:.1f} s" if got.after_fault is not None else "no FAULT line"
    first = (said[0] if said else summary or "(nothing)")[:170]
    observed = f"ended {when} after the fault, status {got.status}; named by {named_by or 'NOBODY'}: {first}"
    if watchdog:
        observed += "; the WATCHDOG fired"
    if got.swap_left:
        folders = sorted({"/".join(p.split("/")[:2]) for p in got.swap_left if p.count("/") >= 2})
        observed += f"; swap folders left: {folders}{' (the killed rank)' if swap_ok else ''}"
    expected = f"job ends within {TARGET_S:g} s, failed rank {job.rank} named, no watchdog"
    return (f"rank failure: {job.name()}", expected, observed, "ok" if ok else "FAIL")


def jobs(full: bool, sample: bool = False) -> list[Job]:
    """The small set (6 jobs), the whole matrix (``full``: 180) or, with ``sample``, a slice of it
    in which every kind, phase and configuration occurs: at 2 ranks each configuration with each
    kind (the phase rotating: 30 jobs), at 4 ranks each kind twice (phase and configuration
    rotating: 10 jobs)."""
    if sample:
        names = list(CONFIGS)
        two = [Job(c, k, PHASES[(i + j) % 3], 2) for i, c in enumerate(names) for j, k in enumerate(KINDS)]
        four = [
            Job(names[(2 * j + t) % 6], k, PHASES[(j + t) % 3], 4)
            for j, k in enumerate(KINDS)
            for t in (0, 1)
        ]
        return two + four
    if not full:
        return [
            Job(c, k, "backward", 2) for c in ("stage 2", "stage 3") for k in ("raise", "exit", "sigkill")
        ]
    return [Job(c, k, p, n) for n in (2, 4) for c in CONFIGS for k in KINDS for p in PHASES]


def run_all(todo: list[Job], workers: int = 2) -> list[Row]:
    """Run ``todo`` (2-rank jobs ``workers`` at a time, 4-rank jobs one at a time), printing progress."""
    rows: dict[Job, Row] = {}
    lock = threading.Lock()
    start = time.monotonic()

    def one(job: Job) -> None:
        row = verdict(job, run_job(job))
        with lock:
            rows[job] = row
            print(
                f"  [{len(rows)}/{len(todo)}, {time.monotonic() - start:.0f} s] {row[0]}: {row[3]} ({row[2][:60]})",
                file=sys.stderr,
                flush=True,
            )

    for size, width in ((2, workers), (4, 1)):
        batch = [j for j in todo if j.nproc == size]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, width)) as pool:
            list(pool.map(one, batch))
    return [rows[j] for j in todo]


def case_rank_failures(full: bool = False, sample: bool = False) -> list[Row]:
    """See the module docstring (``sample``: see :func:`jobs`)."""
    return run_all(jobs(full, sample))


CASES = [case_rank_failures]
