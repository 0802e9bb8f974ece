"""ZERO_OPS_FORCE_FALLBACK=1: one warning, op_report says fallback, same results as native."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from zero_ops.adam import cpu_adam_step

SCRIPT = r"""
import json, sys, warnings, torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import zero_ops
    from zero_ops.adam import cpu_adam_step
    from zero_ops.aio import AsyncIOHandle
    torch.manual_seed(0)
    n = 5003
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        cpu_adam_step(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.1, low_precision_out=out)
    h = AsyncIOHandle()
    h.sync_pwrite(p, sys.argv[1])
    back = torch.empty_like(p)
    h.sync_pread(back, sys.argv[1])
    assert torch.equal(back, p)
msgs = [str(w.message) for w in caught if "fallback" in str(w.message)]
print(json.dumps({"report": zero_ops.op_report(), "warnings": msgs, "p": p.tolist(),
                  "out_ok": torch.equal(out, p.to(torch.bfloat16))}))
"""


def test_forced_fallback(tmp_path):
    env = dict(os.environ, ZERO_OPS_FORCE_FALLBACK="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "f.bin")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res["warnings"]) == 1, res["warnings"]  # exactly one warning, with the reason
    assert "ZERO_OPS_FORCE_FALLBACK" in res["warnings"][0]
    assert all(r["status"] == "fallback" for r in res["report"])
    assert res["out_ok"]
    # Same computation in this process (native when built) gives the same parameters.
    torch.manual_seed(0)
    n = 5003
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    for step in (1, 2, 3):
        cpu_adam_step(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    fallback = torch.tensor(res["p"])
    torch.testing.assert_close(p, fallback, rtol=1e-6, atol=1e-6 * fallback.abs().max().item())
