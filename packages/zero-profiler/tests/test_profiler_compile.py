"""A model first compiled while it is being profiled, in a process where Dynamo was not loaded yet.

See [Note: profiling compiled models]. Runs in a fresh interpreter: in this test process another
test may already have imported ``torch._dynamo``, which is the other (easier) case, covered by
``test_profiler_api.py::test_compiled_module_is_counted``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    import torch, torch.nn as nn, torch.nn.functional as F
    from zero_profiler import FlopsProfiler

    warnings.simplefilter("ignore")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x):
            return x + F.gelu(self.fc(self.ln(x))) @ torch.eye(16)

    model = nn.Sequential(Block(), Block())
    x = torch.randn(4, 16)
    per_call = 2 * (5 * 64 + 2 * 64 * 16 + 64 + 2 * 64 * 16 + 64)
    assert "torch._dynamo" not in sys.modules
    prof = FlopsProfiler(model)
    prof.start_profile()
    compiled = torch.compile(model, backend=sys.argv[1])  # Dynamo is first loaded here
    for _ in range(3):
        compiled(x)
    flops = prof.get_total_flops()
    block = prof.module_stats(model[0]).fwd_flops
    prof.end_profile()
    print(flops, block, per_call)
    assert flops == 3 * per_call, (flops, 3 * per_call)
    assert block == 3 * per_call // 2, block
    """
)


def test_model_first_compiled_while_profiling_is_counted_exactly():
    for backend in ("eager", "aot_eager"):
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, backend], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
