"""The runner behind ``hatch test``: it recognises ``--all``, maps environments to packages, and its
summary lists every package of the matrix, failing when any failed or never reported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import run_package_tests as r  # noqa: E402


def test_matrix_is_every_package_with_the_facade_last():
    packages = r.matrix_packages()
    assert sorted(packages) == sorted(p.name for p in (ROOT / "packages").iterdir() if p.is_dir())
    assert packages[-1] == "zero"  # the summary is printed by the last environment hatch runs


def test_test_all_flag_and_env_names():
    assert r.is_test_all(["/usr/bin/python3", "/usr/bin/hatch", "test", "--all"])
    assert r.is_test_all(["hatch", "-v", "test", "-pa", "--", "-k", "x"])
    assert not r.is_test_all(["hatch", "test", "-i", "pkg=zero-core"])
    assert not r.is_test_all(["hatch", "test", "--", "-a"])  # pytest's argument, not hatch's
    assert not r.is_test_all(["hatch", "run", "test", "--all"][:2])
    packages = r.matrix_packages()
    assert r.package_of_env("hatch-test.py3.11-zero-core", packages) == "zero-core"
    assert r.package_of_env("hatch-test.py3.11-zero", packages) == "zero"
    assert r.package_of_env("default", packages) is None


def test_summary_counts_every_package_and_fails_on_any_failure():
    ok = {"exit": 0, "counts": {"passed": 3, "skipped": 1}, "seconds": 2.0}
    bad = {"exit": 1, "counts": {"passed": 2, "failed": 1}, "seconds": 3.0}
    text, passed = r.summary(["a", "b"], {"a": ok, "b": ok})
    assert passed and "total            ok     6 passed, 2 skipped (4 s of tests, 0 s CPU)" in text
    text, passed = r.summary(["a", "b", "c"], {"a": ok, "b": bad})
    assert not passed
    assert "b                FAILED 2 passed, 1 failed" in text
    assert "c                DID NOT RUN" in text


def test_env_prefetch_creates_later_environments_in_order_and_reports_a_failure(tmp_path):
    """The background creation runs ``<hatch prefix> env create NAME`` for each later environment
    in order, and a runner waiting for one learns when it failed (hatch then creates it itself)."""
    import env_prefetch

    fake_hatch = tmp_path / "hatch"
    calls = tmp_path / "calls.txt"
    fake_hatch.write_text(
        "import sys\n"
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "sys.exit(3 if sys.argv[-1] == 'env-bad' else 0)\n"
    )
    folder = tmp_path / "run"
    argv = [sys.executable, str(fake_hatch), "-v", "test", "--all"]
    env_prefetch.start(folder, os.getpid(), argv, ["env-a", "env-bad", "env-c"])
    assert env_prefetch.wait_for(folder, "env-a") is None
    failure = env_prefetch.wait_for(folder, "env-bad")
    assert failure and "env-bad" in failure
    assert env_prefetch.wait_for(folder, "env-c") is None
    assert calls.read_text().splitlines() == [
        "-v env create env-a",
        "-v env create env-bad",
        "-v env create env-c",
    ]
    assert env_prefetch.wait_for(tmp_path / "never-started", "env-a") is None  # nothing to wait for
