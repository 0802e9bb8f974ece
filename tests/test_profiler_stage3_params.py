"""zero-profiler counts the full size of parameters that zero-core's stage 3 partitioned.

Cross-package (zero-profiler depends on torch only, so this lives outside its own tests).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from zero_profiler.report import count_params


def _count_under_zero_core_stage3():
    from zero_core.zero.stage3.partitioned_param import partition_param

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 3))
    full = count_params(model)
    for p in model.parameters():
        partition_param(p)
    return full, count_params(model), sum(p.numel() for p in model.parameters())


def test_zero_core_stage3_partitioned_params_count_full_size():
    # zero-core's stage 3 records the full size as ``zero_numel`` on each partitioned parameter.
    from zero_core.testing import run_multirank

    for full, counted, local in run_multirank(_count_under_zero_core_stage3, 2):
        assert full == counted == 10 * 7 + 7 + 7 * 3 + 3
        assert local == 0  # released: no local elements visible through .numel()
