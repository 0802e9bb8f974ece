"""Run one package's tests for ``hatch test``; under ``hatch test --all``, one summary at the end.

[Note: one summary for hatch test --all]
``hatch test --all`` runs the environments of the ``hatch-test`` matrix (one per package, see
hatch.toml) one after another, and stops at the first whose command fails: the packages after
it never run, and nothing says how many tests passed where. hatch has no option to go on, so its
``run`` script is this file. Run by ``hatch test --all``, it records each package's counts in a
folder named after that hatch process, exits 0 so that hatch goes on, and in the environment of
the matrix's last package prints every package's counts and exits 1 if any package failed (or
never reported, e.g. because its environment could not be created). Run any other way
(``hatch test -i pkg=zero-core``, or by hand), it is plain pytest with pytest's exit status.

Which hatch invocation started it is read from the process tree (``/proc``): the nearest
ancestor whose command line is ``hatch ... test ...``. Without ``/proc`` (not Linux), every
environment reports its own status and hatch stops at the first failure, as it would by itself.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import env_prefetch
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
COUNTED = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
#: hatch test's flags without a value; a cluster such as ``-pa`` holds ``-a`` (--all)
_FLAG_LETTERS = set("acprs")


def matrix_packages(hatch_toml: Path = ROOT / "hatch.toml") -> list[str]:
    """The ``pkg`` values of the hatch-test matrix, in the order hatch runs them."""
    config = tomllib.loads(hatch_toml.read_text())
    packages: list[str] = []
    for entry in config["envs"]["hatch-test"]["matrix"]:
        packages += [p for p in entry.get("pkg", []) if p not in packages]
    return packages


def package_of_env(env_name: str, packages: list[str]) -> str | None:
    """``hatch-test.py3.11-zero-core`` -> ``zero-core`` (None when no package of the matrix)."""
    matches = [p for p in packages if env_name.endswith("-" + p)]
    return max(matches, key=len) if matches else None  # zero-core over zero


def is_test_all(argv: list[str]) -> bool:
    """Whether a hatch command line is ``hatch ... test ... --all`` (or ``-a``, ``-pa`` ...)."""
    if "test" not in argv:
        return False
    for arg in argv[argv.index("test") + 1 :]:
        if arg == "--":
            break
        if arg == "--all":
            return True
        if arg.startswith("-") and not arg.startswith("--") and set(arg[1:]) <= _FLAG_LETTERS:
            if "a" in arg:
                return True
    return False


def _ancestors() -> list[tuple[int, list[str], str]]:
    """(pid, argv, start time) of this process's ancestors, nearest first (Linux /proc)."""
    out = []
    pid = os.getppid()
    while pid > 1:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        out.append((pid, [a.decode(errors="replace") for a in argv if a], fields[19]))
        pid = int(fields[1])
    return out


def hatch_test_all() -> tuple[int, list[str], str] | None:
    """(pid, argv, start time) of the ``hatch test --all`` process this runs under, or None."""
    for pid, argv, started in _ancestors():
        if any(Path(a).name == "hatch" for a in argv[:3]) and "test" in argv:
            return (pid, argv, started) if is_test_all(argv) else None
    return None


def hatch_run_id() -> str | None:
    """An id of the ``hatch test --all`` process this runs under, or None."""
    hatch = hatch_test_all()
    return f"{hatch[0]}-{hatch[2]}" if hatch else None


class _Counts:
    """pytest plugin: the counts pytest prints in its last line."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def pytest_terminal_summary(self, terminalreporter) -> None:  # noqa: ANN001 (pytest's hook)
        stats = terminalreporter.stats
        self.counts = {k: len(stats[k]) for k in COUNTED if stats.get(k)}


def summary(packages: list[str], results: dict[str, dict]) -> tuple[str, bool]:
    """The table of every package's counts, and whether every package passed."""
    lines = ["", "=" * 30 + " hatch test --all: every package " + "=" * 30]
    ok = True
    for pkg in packages:
        res = results.get(pkg)
        if res is None:
            ok = False
            lines.append(f"{pkg:<16} DID NOT RUN (its environment failed before its tests started)")
            continue
        passed = res["exit"] == 0
        ok &= passed
        counts = ", ".join(f"{n} {k}" for k, n in res["counts"].items()) or "no tests"
        cpu = f", {res['cpu_seconds']:.0f} s CPU" if "cpu_seconds" in res else ""
        lines.append(f"{pkg:<16} {'ok    ' if passed else 'FAILED'} {counts} ({res['seconds']:.0f} s{cpu})")
    totals: dict[str, int] = {}
    for res in results.values():
        for k, n in res["counts"].items():
            totals[k] = totals.get(k, 0) + n
    seconds = sum(res["seconds"] for res in results.values())
    cpu = sum(res.get("cpu_seconds", 0.0) for res in results.values())
    lines.append(
        f"{'total':<16} {'ok    ' if ok else 'FAILED'} "
        + ", ".join(f"{n} {k}" for k, n in totals.items())
        + f" ({seconds:.0f} s of tests, {cpu:.0f} s CPU)"
    )
    return "\n".join(lines), ok


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (xdist workers, ranks, launches)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(args: list[str]) -> int:
    hatch = hatch_test_all()
    packages = matrix_packages()
    env_name = os.environ.get("HATCH_ENV_ACTIVE", "")
    pkg = package_of_env(env_name, packages)
    if hatch is None or pkg is None:
        return int(pytest.main(args))
    folder = Path(tempfile.gettempdir()) / "zero-hatch-test" / f"{hatch[0]}-{hatch[2]}"
    folder.mkdir(parents=True, exist_ok=True)
    env_of = {p: env_name[: -len(pkg)] + p for p in packages}  # hatch-test.py3.11-<pkg>
    later = packages[packages.index(pkg) + 1 :]
    if pkg == packages[0]:  # See [Note: a fresh hatch test --all in minutes]
        env_prefetch.start(folder, hatch[0], hatch[1], [env_of[p] for p in later])

    counter = _Counts()
    start, cpu = time.monotonic(), _cpu_seconds()
    status = int(pytest.main(args, plugins=[counter]))
    record = {
        "exit": status,
        "counts": counter.counts,
        "seconds": time.monotonic() - start,
        "cpu_seconds": _cpu_seconds() - cpu,
    }
    (folder / f"{pkg}.json").write_text(json.dumps(record))
    if later:
        failure = env_prefetch.wait_for(folder, env_of[later[0]])
        if failure:
            print(failure)
        print(f"\n[{pkg}: exit status {status}; hatch test --all goes on, summary after {packages[-1]}]")
        return 0
    results = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}
    shutil.rmtree(folder, ignore_errors=True)
    text, ok = summary(packages, results)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
