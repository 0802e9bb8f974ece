"""hatch test's xdist order (tools/longest_files_first.py): the longest files first, every test
kept, each file's tests together and in pytest's order; the table names only files that exist,
and hatch.toml wires the plugin with xdist's own reordering off."""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import longest_files_first as lff  # noqa: E402


def test_longest_files_first_keeps_every_test_and_each_files_order():
    ids = ["a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2", "d.py::t1", "e.py::t1"]
    order = [ids[i] for i in lff.longest_first(ids, {"c.py": 50.0, "d.py": 80.0, "a.py": 1.0})]
    assert order == ["d.py::t1", "c.py::t1", "c.py::t2", "a.py::t1", "a.py::t2", "b.py::t1", "e.py::t1"]
    assert sorted(order) == sorted(ids)


def test_table_names_existing_files_and_hatch_passes_the_plugin():
    seconds = lff.expected_seconds()
    assert seconds and all(s > 0 for s in seconds.values())
    missing = [name for name in seconds if not (ROOT / name).is_file()]
    assert not missing, f"tools/test_file_seconds.json names files that do not exist: {missing}"
    hatch_test = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"]["hatch-test"]
    args = hatch_test["extra-args"]
    assert args[args.index("--dist") + 1] == "loadfile" and "--no-loadscope-reorder" in args
    assert args[args.index("-p") + 1] == "longest_files_first"


def test_expected_left_counts_the_tests_still_to_run():
    assigned = {
        "a.py": {"a.py::t1": True, "a.py::t2": False},
        "b.py": {"b.py::t": False},
        "c.py": {"c.py::t": True},
    }
    assert lff.expected_left(assigned, {"a.py": 10.0, "b.py": 3.0, "c.py": 99.0}) == 8.0
    assert lff.expected_left({}, {"a.py": 10.0}) == 0.0
