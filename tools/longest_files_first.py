"""pytest plugin for hatch test's xdist workers: the longest test files are handed out first.

[Note: longest test files first]
``hatch test`` runs each package's tests on two pytest-xdist workers with ``--dist loadfile``
(hatch.toml): a file is one unit of work, and the controller hands the units out in a fixed
order, the next one to whichever worker is about to run dry. By default xdist sorts the units
by their number of tests, most first. That puts a file of one or two long tests (a 4-rank
``zero run`` job, an autotuning search, a pip install) at the end of the queue, where one
worker runs it alone while the other has nothing left: on two cores the package's wall time
becomes that file's time plus everything before it. Handing out the longest files first and
the short ones after (the greedy "longest processing time first" rule) lets the short files
fill in beside the long ones, so both workers finish close together.

The controller takes the order from the workers' collection, so this plugin sorts each
worker's collected items by the expected seconds of their file, longest first, keeping
pytest's order within a file and among files of equal weight; hatch.toml passes
``--no-loadscope-reorder`` so xdist keeps that order. Only the order changes: every test still
runs, in one worker, with its file's fixtures. The expected seconds are in
``test_file_seconds.json`` next to this file (the CPU seconds each file took, measured on the
2-core machine: the order is what matters, not the figures); a file not listed counts as 0 and
keeps its place after the listed ones. Outside an xdist worker (plain pytest) nothing changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SECONDS = Path(__file__).resolve().with_name("test_file_seconds.json")


def expected_seconds(path: Path = SECONDS) -> dict[str, float]:
    """``{file's node id: seconds}``: ``packages/zero-core/tests/test_x.py`` -> its seconds."""
    table = json.loads(path.read_text())
    return {name: float(s) for name, s in table["seconds"].items()}


def longest_first(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """Indices of ``nodeids`` ordered by their file's seconds, longest first; stable otherwise."""
    weight = [seconds.get(nodeid.split("::", 1)[0], 0.0) for nodeid in nodeids]
    return sorted(range(len(nodeids)), key=lambda i: -weight[i])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: See [Note: longest test files first]
        return
    order = longest_first([item.nodeid for item in items], expected_seconds())
    items[:] = [items[i] for i in order]
