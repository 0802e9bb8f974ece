"""Issue 25's runtime fault injection, in its small (CI) size: every case of
``tools/faults/runtime_cases.py`` must come out ``ok``.

One test per case function, so a failure names the fault: mismatched ranks named at
``initialize``; save_checkpoint called on one rank / with different tags under
tag_validation Warn/Fail/Ignore; a rank stalled at stages 2 and 3 named by the collective
watchdog with every process exiting; clean exits of 4-rank ``zero run`` jobs (2 runs here,
stages 1 and 3; ``python tools/faults/run_faults.py --full`` runs 20, 5 per stage); SIGTERM
with NVMe offload leaving no swap files.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "faults" / "runtime_cases.py"
_spec = importlib.util.spec_from_file_location("zero_faults_runtime_cases", _PATH)
cases = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cases
_spec.loader.exec_module(cases)


@pytest.mark.parametrize("case", cases.CASES, ids=[f.__name__ for f in cases.CASES])
def test_runtime_fault_case(case):
    rows = case(full=False)
    assert rows, f"{case.__name__} produced no rows"
    failed = [r for r in rows if r[3] != "ok"]
    assert not failed, "\n".join(f"{c}: expected {e}; observed {o}" for c, e, o, _ in failed)
