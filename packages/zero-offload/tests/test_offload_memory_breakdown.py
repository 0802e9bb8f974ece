"""With offload, ``memory_breakdown()`` still counts each live storage once.

Device-side categories and the offload's ``host_*`` pools together equal the distinct storages
of every live tensor (found by the garbage collector), after forward (activations saved for
backward set apart), backward and step; at stages 1, 2 and 3, fp32, bf16 and fp16, optimizer
offload to CPU and NVMe and, at stage 3, parameter offload to CPU. Keys naming NVMe bytes are file bytes,
not memory, and are left out of the sum. See [Note: memory breakdown counts storages] in
zero_core/utils/storage_bytes.py.
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.memory import SavedForBackward, StorageBaseline, live_storages, measure_until_equal
from zero_core.testing.models import MLPClassifier, classification_batch

CASES = [
    (2, "fp32", {"offload_optimizer": {"device": "cpu"}}),
    (2, "bf16", {"offload_optimizer": {"device": "cpu"}}),
    (3, "fp32", {"offload_optimizer": {"device": "cpu"}}),
    (3, "bf16", {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    (3, "fp32", {"offload_optimizer": {"device": "nvme", "nvme_path": None, "buffer_count": 3}}),
]
# the remaining stage / precision / offload combinations, on 2 ranks only (CI time)
MORE_CASES = [
    (1, "bf16", {"offload_optimizer": {"device": "cpu"}}),
    (2, "fp16", {"offload_optimizer": {"device": "cpu"}}),
    (2, "bf16", {"offload_optimizer": {"device": "nvme", "nvme_path": None, "buffer_count": 3}}),
    (3, "fp32", {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    (3, "fp16", {"offload_optimizer": {"device": "cpu"}}),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _one_case(stage: int, precision: str, offload: dict) -> list[tuple]:
    import zero_core

    before = StorageBaseline()
    torch.manual_seed(0)
    model = MLPClassifier(32, 64, 8)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **offload},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    engine, *_ = zero_core.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=cfg
    )
    dtype = DTYPES[precision]
    out = []

    def once(held: list, saved: set) -> tuple[int, int, dict]:
        live = live_storages([*held, *engine.held_step_scalars()], before)
        params = {(str(p.device), p.untyped_storage().data_ptr()) for p in model.parameters()}
        activations = sum(live[k] for k in saved if k in live and k not in params)
        bd = engine.memory_breakdown()
        reported = sum(v for k, v in bd.items() if "nvme" not in k)
        return sum(live.values()) - activations, reported, bd

    def measure(phase: str, held: list, saved: set = frozenset()) -> None:
        # See [Note: collective buffers outlive wait()] in zero_core/testing/memory.py
        live, reported, bd = measure_until_equal(lambda: once(held, saved))
        out.append((stage, precision, sorted(offload), phase, live, reported, bd))

    for i in range(2):
        x, y = classification_batch(i, 4, 32, 8)
        x = x.to(dtype)
        rec = SavedForBackward()
        with rec.recording():
            loss = engine(x, y)
        measure(f"forward {i}", [x, y, loss], rec.keys)
        engine.backward(loss)
        measure(f"backward {i}", [x, y, loss])
        engine.step()
        measure(f"step {i}", [x, y, loss])
    engine.destroy()
    return out


def _case_rank(nvme: str, cases: list = CASES) -> list[tuple]:
    rows = []
    for stage, precision, offload in cases:
        if "nvme_path" in offload["offload_optimizer"]:
            offload = {**offload, "offload_optimizer": {**offload["offload_optimizer"], "nvme_path": nvme}}
        rows += _one_case(stage, precision, offload)
    return rows


@pytest.mark.parametrize("world", [1, 2])
def test_offload_breakdown_counts_live_storages_once(world: int, tmp_path) -> None:
    for rank, rows in enumerate(run_multirank(_case_rank, world, args=(str(tmp_path),), timeout=600)):
        for stage, precision, offload, phase, live, reported, bd in rows:
            assert reported == live, f"{(rank, stage, precision, offload, phase, live, bd)}"


def test_offload_breakdown_counts_live_storages_once_more_cases(tmp_path) -> None:
    """Stage 1, fp16, NVMe at stage 2 and fp32 parameter offload (2 ranks)."""
    for rank, rows in enumerate(run_multirank(_case_rank, 2, args=(str(tmp_path), MORE_CASES), timeout=600)):
        for stage, precision, offload, phase, live, reported, bd in rows:
            assert reported == live, f"{(rank, stage, precision, offload, phase, live, bd)}"
