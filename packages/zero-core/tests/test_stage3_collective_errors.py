"""A hang is a bug: divergent ranks and a rank that never joins give clear, bounded errors.

See [Note: stage 3 collective agreement]. Both tests run with the default settings except a
short collective timeout; the timeout test also turns the agreement checks off, to show that
the data collectives' own waits are bounded and name the parameters.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.multirank import RankFailedError


class Diverging(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 8)
        self.c = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zero_core import comm

        if comm.get_rank() != 1:  # the bug under test: rank 1 skips a module
            x = self.a(x)
        return self.c(self.b(x)).sum()


def _engine(model: torch.nn.Module):  # noqa: ANN202
    import zero_core

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "param_persistence_threshold": 0},
    }
    return zero_core.initialize(model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), config=cfg)[0]


def _mismatch_rank() -> None:
    import zero_core
    from zero_core.zero.stage3 import set_collective_timeout

    set_collective_timeout(5)
    with zero_core.Init():
        model = Diverging()
    _engine(model)(torch.randn(2, 4))


def test_mismatch_is_a_clear_error_not_a_hang() -> None:
    with pytest.raises(RankFailedError) as info:
        run_multirank(_mismatch_rank, 2, timeout=60)
    text = str(info.value)
    assert "ranks disagree on the next collective" in text
    assert "a.weight" in text and "b.weight" in text


TIMEOUT_S = 2.0


def _absent_rank() -> None:
    from zero_core import comm
    from zero_core.zero.stage3 import set_collective_checks, set_collective_timeout

    set_collective_timeout(TIMEOUT_S)
    set_collective_checks(False)
    engine = _engine(Diverging())
    if comm.get_rank() == 1:
        time.sleep(4 * TIMEOUT_S)  # alive, but never joins the forward's all-gather
        return
    start = time.perf_counter()
    try:
        engine(torch.randn(2, 4))
    except Exception as exc:
        raise RuntimeError(f"failed after elapsed={time.perf_counter() - start:.2f}s") from exc


def test_rank_that_never_joins_times_out_naming_the_parameter() -> None:
    with pytest.raises(RankFailedError) as info:
        run_multirank(_absent_rank, 2, timeout=60)
    text = str(info.value)
    assert "Stage3CollectiveError" in text and f"did not complete within {TIMEOUT_S:g} s" in text
    assert "a.weight" in text, text
    elapsed = float(re.search(r"elapsed=([0-9.]+)s", text).group(1))
    assert TIMEOUT_S * 0.9 <= elapsed <= TIMEOUT_S + 5.0, elapsed
