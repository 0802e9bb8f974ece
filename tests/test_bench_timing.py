"""The step-time benchmarks' statistics (tools/bench/_timing.py): per-pass ratios, quartiles, and the
``--check`` comparison with the README's quoted figures. No timing is measured here: the records are
made up, the arithmetic on them is what is checked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_timing", ROOT / "tools" / "bench" / "_timing.py")
timing = importlib.util.module_from_spec(_spec)
sys.modules["bench_timing"] = timing  # dataclasses look their module up
_spec.loader.exec_module(timing)


def _passes(walls: list[list[float]], cpu_factor: float = 0.1) -> list[list]:
    return [[timing.StepRecord(w, w * cpu_factor, {}) for w in p] for p in walls]


def test_ratios_are_taken_pass_by_pass() -> None:
    # the load doubles in pass 2: a pooled median would mix the passes, the per-pass ratio does not
    base = _passes([[1.0, 1.0, 1.2], [2.0, 2.0, 2.2], [1.0, 1.0, 1.0], [1.0, 1.1, 1.0], [3.0, 3.0, 3.0]])
    var = _passes([[1.1, 1.1, 1.3], [2.2, 2.2, 2.4], [1.1, 1.1, 1.1], [1.1, 1.21, 1.1], [3.3, 3.3, 3.3]])
    q1, med, q3 = timing.ratio_quartiles(var, base, "wall")
    assert med == pytest.approx(1.1)
    assert q1 == pytest.approx(1.1) and q3 == pytest.approx(1.1)
    assert timing.ratio_quartiles(var, base, "cpu")[1] == pytest.approx(1.1)
    with pytest.raises(ValueError):
        timing.ratio_quartiles(var[:4], base, "wall")  # passes must pair up


def test_quartiles_and_format() -> None:
    assert timing.quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (2.0, 3.0, 4.0)
    assert timing.quartiles([7.0]) == (7.0, 7.0, 7.0)
    with pytest.raises(ValueError):
        timing.quartiles([])
    assert timing.fmt_iqr((0.98, 1.01, 1.04)) == "1.01 (0.98-1.04)"


def test_merge_ranks_pools_each_pass() -> None:
    r0 = {"a": _passes([[1.0], [2.0]])}
    r1 = {"a": _passes([[3.0], [4.0]])}
    merged = timing.merge_ranks([r0, r1])
    assert [[r.wall for r in p] for p in merged["a"]] == [[1.0, 3.0], [2.0, 4.0]]


def test_check_against_quotes(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        "| benchmark | comparison | wall ratio, median (IQR) | CPU ratio, median (IQR) |\n"
        "|---|---|---|---|\n"
        "| bench_zero12 | stage2/ddp fp32 | 1.05 (0.95-1.20) | 1.02 (1.01-1.03) |\n"
        "| bench_zero3 | zero3/fsdp2 fp32 | 0.90 (0.80-1.00) | 0.95 (0.94-0.97) |\n"
    )
    quotes = timing.readme_quotes(readme, "bench_zero12")
    assert quotes == {"stage2/ddp fp32": (1.05, 1.02)}
    inside = {"stage2/ddp fp32": ((1.0, 1.04, 1.1), (1.0, 1.02, 1.04))}
    lines, ok = timing.check_lines(quotes, inside)
    assert ok and all("inside" in line for line in lines)
    outside = {"stage2/ddp fp32": ((1.0, 1.04, 1.1), (1.03, 1.05, 1.06))}
    lines, ok = timing.check_lines(quotes, outside)
    assert not ok and any("OUTSIDE" in line and "cpu" in line for line in lines)
    assert not timing.check_lines(quotes, {})[0] == [] and not timing.check_lines(quotes, {})[1]
    assert timing.check_lines({}, inside)[1] is False


def test_the_readme_quotes_what_the_scripts_measure() -> None:
    """Every quoted row names a comparison the benchmark produces, so ``--check`` can find it."""
    z12 = timing.readme_quotes(ROOT / "README.md", "bench_zero12")
    z3 = timing.readme_quotes(ROOT / "README.md", "bench_zero3")
    assert set(z12) == {"stage0/ddp fp32", "stage1/ddp fp32", "stage2/ddp fp32"}
    assert set(z3) == {"zero3/fsdp2 fp32", "zero3/fsdp2 bf16"}


def test_union_of_overlapping_spans() -> None:
    assert timing.union_seconds([]) == 0.0
    assert timing.union_seconds([(0.0, 10.0), (5.0, 15.0), (20.0, 21.0)]) == pytest.approx(16e-6)
    assert timing.union_seconds([(5.0, 6.0), (0.0, 10.0)]) == pytest.approx(10e-6)  # nested, any order


def _profiled_direct_collectives() -> None:
    import torch
    from zero_core import comm

    full, piece, gathered = torch.ones(2_000_000), torch.empty(1_000_000), torch.empty(2_000_000)

    def step() -> None:
        works = [comm.reduce_scatter_tensor(piece, full, async_op=True) for _ in range(3)]
        for w in works:
            w.wait()
        comm.all_gather_into_tensor(gathered, piece)

    step()
    seconds = timing.collective_seconds(step)
    assert seconds["reduce"] > 0 and seconds["gather"] > 0, seconds


def test_collective_seconds_counts_direct_exchanges() -> None:
    from zero_core.testing import run_multirank

    run_multirank(_profiled_direct_collectives, 2, timeout=120)
