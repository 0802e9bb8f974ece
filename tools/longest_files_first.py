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
``--no-loadscope-reorder`` so xdist keeps that order.

One catch: an xdist worker runs a test only once it holds the next one (pytest's teardown
needs ``nextitem``), so xdist hands a worker its next file as soon as two or fewer of its tests
are left: the moment a worker starts a file of one long test, it is given another file, which
waits behind that test. Taken from the front of the queue, that is the next-longest file, and
the two longest files end up one after the other on one worker while the other runs everything
else (seen: the a-la-carte install queued behind the autotuning search). So the controller's
scheduler (``pytest_xdist_make_scheduler`` below, xdist's ``loadfile`` otherwise unchanged) gives
a worker whose assigned tests still hold more than ``BUSY_S`` expected seconds the shortest file
left, and a worker about to run dry the longest.

Only the order changes: every test still runs, in one worker, with its file's fixtures. The
expected seconds are in
``test_file_seconds.json`` next to this file (the CPU seconds each file took, measured on the
2-core machine: the order is what matters, not the figures); a file not listed counts as 0 and
keeps its place after the listed ones. Outside an xdist worker (plain pytest) nothing changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SECONDS = Path(__file__).resolve().with_name("test_file_seconds.json")
#: a worker with more expected seconds than this still to run gets the shortest file left
BUSY_S = 5.0


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


def expected_left(assigned: dict[str, dict[str, bool]], seconds: dict[str, float]) -> float:
    """Expected seconds of a worker's assigned files still to run: ``{file: {test: done}}``."""
    left = 0.0
    for scope, tests in assigned.items():
        pending = sum(not done for done in tests.values())
        if pending:
            left += seconds.get(scope, 0.0) * pending / len(tests)
    return left


@pytest.hookimpl(optionalhook=True)  # xdist's hook: no error where xdist is absent or disabled
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 (xdist's hook)
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFilesFirst(LoadFileScheduling):
        """``loadfile``, but a busy worker's next file is the shortest left: See [Note: longest
        test files first]. The queue is longest first (the workers' collection order)."""

        seconds = expected_seconds()

        def _assign_work_unit(self, node) -> None:  # noqa: ANN001 (xdist's WorkerController)
            busy = expected_left(self.assigned_work.get(node, {}), self.seconds) > BUSY_S
            if busy and len(self.workqueue) > 1:
                self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
            super()._assign_work_unit(node)

    return LongestFilesFirst(config, log)
