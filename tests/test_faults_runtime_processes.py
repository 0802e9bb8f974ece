"""Issue 25's runtime fault injection, the cases that start real interpreters
(``PROCESS_CASES`` of ``tools/faults/runtime_cases.py``), in their small (CI) size: every row
must come out ``ok``. The forked-rank cases are in test_faults_runtime.py; the two files are
apart so that pytest-xdist's ``--dist loadfile`` runs them on both workers.

One test per case function, so a failure names the fault: a stage-3 stall through ``zero run``
ends the job naming rank 1; clean exits of 4-rank ``zero run`` jobs (2 runs here, stages 1 and
3; ``python tools/faults/run_faults.py --full`` runs 20, 5 per stage); SIGTERM with NVMe
offload leaving no swap files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from zero_core.testing.scripts import load_script

cases = load_script(
    Path(__file__).resolve().parents[1] / "tools" / "faults" / "runtime_cases.py", "zero_faults_runtime_cases"
)


@pytest.mark.parametrize("case", cases.PROCESS_CASES, ids=[f.__name__ for f in cases.PROCESS_CASES])
def test_runtime_fault_case(case):
    cases.assert_ok(case)
