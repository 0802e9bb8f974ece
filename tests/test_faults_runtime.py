"""Issue 25's runtime fault injection, in its small (CI) size: every case of
``tools/faults/runtime_cases.py`` must come out ``ok``. This file holds the cases run in forked
ranks; those that start real interpreters are in test_faults_runtime_processes.py.

One test per case function, so a failure names the fault: mismatched ranks named at
``initialize``; save_checkpoint called on one rank / with different tags under
tag_validation Warn/Fail/Ignore; a rank stalled at stages 2 and 3 named by the collective
watchdog with every process exiting.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from zero_core.testing.scripts import load_script

cases = load_script(
    Path(__file__).resolve().parents[1] / "tools" / "faults" / "runtime_cases.py", "zero_faults_runtime_cases"
)

IN_PROCESS = [c for c in cases.CASES if c not in cases.PROCESS_CASES]


@pytest.mark.parametrize("case", IN_PROCESS, ids=[f.__name__ for f in IN_PROCESS])
def test_runtime_fault_case(case):
    cases.assert_ok(case)
