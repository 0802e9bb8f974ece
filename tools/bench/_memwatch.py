"""Run a job of several processes under a memory ceiling, and keep the machine usable meanwhile.

[Note: memory ceiling of a benchmark job]
A job (the ranks of one training run) passes a ceiling of ``C`` bytes when the sum of its
processes' peak resident sets stays at or below ``C``. The peak of each process is the kernel's
own high-water mark (``VmHWM`` in ``/proc/PID/status``), so no spike between two samples is
missed; the watcher reads it every ``poll`` seconds (0.1 by default) for every process of the
job (the launched ones and their descendants) and kills the whole job with SIGKILL as soon as the
sum passes ``C``. A process's last peak counts after it exits; a job that prints a ``RESULT
{json}`` line with ``peak_rss`` (its own ``VmHWM`` at the end) has that folded in, which closes
the last sampling gap. Other processes of the job (DeepSpeed starts a Python subprocess to read the CPU's
features at import, and compiler probes while it builds its engine) count with their private
pages (``smaps_rollup``), sampled, and only while they live: between its fork and its exec a
child maps every page of its parent, so its RSS would count a rank twice (seen here: DeepSpeed
NVMe jobs read 5.3-5.6 GiB summing RSS, where their ranks' own peaks were 3.5-3.7 GiB). The job's figure is the largest,
over the samples, sum of what its live processes hold; for the ranks, which live from start to
end, that is the sum of their peak RSS, the figure the issue states its target in. It is conservative: pages shared between ranks (the torch libraries,
~0.2-0.3 GiB a rank) count once per rank, and two ranks' peaks count together even if they came
at different moments. The largest sampled instantaneous sums of RSS and of anonymous RSS are
reported beside it.

Where the cgroup-v1 memory controller is writable (``/sys/fs/cgroup/memory``), the job also runs
in its own cgroup limited to 1.05 C: a backstop against an allocation faster than the sampling
(the kernel then kills the job inside its cgroup, never another process). RLIMIT_AS is not used:
torch reserves far more address space than it touches.

The machine is shared: :func:`wait_for_available` holds a job back until ``MemAvailable`` leaves
room for the whole ceiling plus a margin, and the watcher stops a job (status ``low-memory``, to be
retried) when ``MemAvailable`` falls under ``min_available`` while it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

GIB = 2**30
CGROUP_ROOT = "/sys/fs/cgroup/memory"


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def mem_available() -> int:
    return meminfo()["MemAvailable"]


def wait_for_available(need: int, max_wait: float, log: Callable[[str], None] = print) -> float:
    """Wait until ``MemAvailable`` >= ``need`` bytes; seconds waited. TimeoutError past ``max_wait``."""
    t0 = time.monotonic()
    last = -1e9
    while (avail := mem_available()) < need:
        waited = time.monotonic() - t0
        if waited > max_wait:
            raise TimeoutError(
                f"MemAvailable stayed under {need / GIB:.1f} GiB for {max_wait:.0f} s "
                f"(now {avail / GIB:.1f} GiB): the machine is too busy for this ceiling"
            )
        if waited - last >= 30:
            log(f"  waiting for memory: MemAvailable {avail / GIB:.1f} GiB < {need / GIB:.1f} GiB needed")
            last = waited
        time.sleep(2)
    return time.monotonic() - t0


def read_status(pid: int) -> tuple[int, int, int] | None:
    """(VmRSS, VmHWM, RssAnon) of ``pid`` in bytes; None once it is gone (or a zombie)."""
    want = {"VmRSS": 0, "VmHWM": 0, "RssAnon": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in want:
                    want[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if want["VmHWM"] == 0:
        return None
    return want["VmRSS"], want["VmHWM"], want["RssAnon"]


def descendants(pids: Sequence[int]) -> list[int]:
    """``pids`` and every live descendant (from ``/proc/PID/task/TID/children``)."""
    seen, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return seen


class MemoryCgroup:
    """A cgroup-v1 memory group for one job: a hard backstop above the watched ceiling."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def create(cls, limit: int) -> MemoryCgroup | None:
        """A new group limited to ``limit`` bytes, or None where the controller is not writable."""
        path = os.path.join(CGROUP_ROOT, f"zero_bench_{os.getpid()}_{time.monotonic_ns()}")
        try:
            os.mkdir(path)
        except OSError:
            return None
        group = cls(path)
        try:
            group._write("memory.limit_in_bytes", str(int(limit)))
        except OSError:
            group.remove()
            return None
        return group

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def join(self) -> None:
        """Move the calling process into the group (a ``preexec_fn``: runs in the child before exec)."""
        self._write("cgroup.procs", str(os.getpid()))

    def procs(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def peak(self) -> int:
        try:
            return int(self._read("memory.max_usage_in_bytes"))
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        try:
            for line in self._read("memory.oom_control").splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        for _ in range(50):  # the last processes may take a moment to leave after SIGKILL
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


@dataclass
class JobResult:
    """How a watched job ended and what it used. ``status``: ok, failed, over, timeout, low-memory."""

    status: str
    reason: str
    seconds: float
    peak_sum: int  # largest sum of the live processes' peak RSS (the enforced figure)
    peak_rss_sum: int  # largest sampled instantaneous sum of RSS
    peak_anon_sum: int  # largest sampled instantaneous sum of anonymous RSS
    cgroup_peak: int | None  # the backstop cgroup's max usage (page cache included); None without one
    returncodes: list[int | None]
    outputs: list[str]  # each launched process's stdout+stderr
    results: list[dict] = field(default_factory=list)  # parsed RESULT lines, in launch order


def private_bytes(pid: int) -> int | None:
    """Pages ``pid`` alone maps (``Private_Clean + Private_Dirty`` of ``smaps_rollup``); None once gone."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return total


class _Tracker:
    """The job's peak: the largest sum, over a sample's live processes, of what each one holds.

    A launched process counts with its peak RSS. Any other process of the job (a descendant)
    counts with its private pages only: right after a fork, and until it execs, a child maps all
    of its parent's pages (copy-on-write), and its RSS would count them a second time.
    """

    def __init__(self, roots: Sequence[int]) -> None:
        self.roots = set(roots)
        self.peak = self.rss_sum = self.anon_sum = 0

    def sample(self, pids: Sequence[int]) -> int:
        rss = anon = held = 0
        for pid in pids:
            if pid in self.roots:
                st = read_status(pid)
                if st is not None:
                    rss += st[0]
                    held += st[1]
                    anon += st[2]
            else:
                own = private_bytes(pid)
                if own is not None:
                    rss, held, anon = rss + own, held + own, anon + own
        self.peak = max(self.peak, held)
        self.rss_sum = max(self.rss_sum, rss)
        self.anon_sum = max(self.anon_sum, anon)
        return self.peak


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _parse_results(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("RESULT "):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line[len("RESULT ") :]))
    return out


def run_job(
    cmds: Sequence[Sequence[str]],
    envs: Sequence[dict[str, str]],
    ceiling: int,
    timeout: float,
    *,
    min_available: int = 0,
    poll: float = 0.1,
    use_cgroup: bool = True,
    grace: float = 20.0,
    cwd: str | None = None,
) -> JobResult:
    """Start ``cmds`` (one process each, with ``envs``) and watch them. See [Note: memory ceiling of a benchmark job].

    A process that fails lets the others run ``grace`` more seconds (they usually fail too, on a
    broken connection) before the rest are killed.
    """
    if len(cmds) != len(envs) or not cmds:
        raise ValueError(f"run_job: need one env per command, got {len(cmds)} commands, {len(envs)} envs")
    if ceiling <= 0 or timeout <= 0:
        raise ValueError(f"run_job: ceiling and timeout must be > 0, got {ceiling}, {timeout}")
    group = MemoryCgroup.create(int(ceiling * 1.05)) if use_cgroup else None
    tmp = tempfile.mkdtemp(prefix="memwatch_")
    logs = [open(os.path.join(tmp, f"p{i}.log"), "w+") for i in range(len(cmds))]  # noqa: SIM115
    procs: list[subprocess.Popen] = []
    status, reason = "ok", ""
    t0 = time.monotonic()
    try:
        for cmd, env, log in zip(cmds, envs, logs, strict=True):
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    env=env,
                    cwd=cwd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=group.join if group else None,
                )
            )
        tracker = _Tracker([p.pid for p in procs])
        status, reason = _watch(procs, group, tracker, ceiling, timeout, min_available, poll, grace, t0)
    finally:
        members = group.procs() if group else []
        _kill(descendants([p.pid for p in procs if p.poll() is None]) + members)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        cg_peak = group.peak() if group else None
        oom = group.oom_kills() if group else 0
        if group:
            group.remove()
    outputs = _read_and_remove(logs, tmp)
    results = [r for text in outputs for r in _parse_results(text)]
    peak = tracker.peak
    reported = sum(r.get("peak_rss", 0) for r in results)
    if len(results) == len(cmds):  # each process's own final VmHWM closes the last sampling gap
        peak = max(peak, reported)
    if status == "failed" and oom:
        status, reason = (
            "over",
            f"killed by the kernel in the job's cgroup (limit {1.05 * ceiling / GIB:.2f} GiB)",
        )
    if status == "ok" and peak > ceiling:
        status, reason = "over", f"sum of peak RSS {peak / GIB:.2f} GiB > ceiling (seen at the end)"
    return JobResult(
        status,
        reason,
        time.monotonic() - t0,
        peak,
        tracker.rss_sum,
        tracker.anon_sum,
        cg_peak,
        [p.returncode for p in procs],
        outputs,
        results,
    )


def _read_and_remove(logs: list, folder: str) -> list[str]:
    """The text of each job log, the logs and their folder removed."""
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
        os.remove(log.name)
    os.rmdir(folder)
    return outputs


def _watch(procs, group, tracker, ceiling, timeout, min_available, poll, grace, t0) -> tuple[str, str]:
    """The polling loop of :func:`run_job`: (status, reason) once the job ended or was stopped."""
    failed_at = None
    while True:
        pids = sorted(set(descendants([p.pid for p in procs]) + (group.procs() if group else [])))
        peak = tracker.sample(pids)
        codes = [p.poll() for p in procs]
        if peak > ceiling:
            return "over", f"sum of peak RSS {peak / GIB:.2f} GiB > ceiling {ceiling / GIB:.2f} GiB"
        if all(c == 0 for c in codes):
            return "ok", ""
        if any(c not in (None, 0) for c in codes):
            failed_at = failed_at or time.monotonic()
            if all(c is not None for c in codes) or time.monotonic() - failed_at > grace:
                if group is None and -signal.SIGKILL in codes:  # with a cgroup, run_job asks it
                    return "over", f"exit codes {codes}: SIGKILL from outside (the kernel's OOM killer?)"
                return "failed", f"exit codes {codes}"
        if time.monotonic() - t0 > timeout:
            return "timeout", f"still running after {timeout:.0f} s"
        if min_available and mem_available() < min_available:
            return "low-memory", f"MemAvailable fell under {min_available / GIB:.1f} GiB (other processes)"
        time.sleep(poll)
