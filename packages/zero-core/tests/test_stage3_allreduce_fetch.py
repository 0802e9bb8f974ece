"""``zero_optimization.use_all_reduce_for_fetch_params``: stage 3 fetches by all-reduce, same results.

See [Note: all-reduce fetch]: every fetch becomes a SUM all-reduce of a zero-padded buffer (the
comms logger sees all-reduces where it saw all-gathers, of the padded full size), and training
is bitwise the all-gather run's and matches single-process PyTorch (fp32, 1e-5) at world sizes
1, 2 and 4; in bf16 too, bitwise.
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import MLPClassifier, classification_batch
from zero_core.testing.parity import (
    assert_states_equal,
    assert_trajectory_close,
    state_snapshot,
    train_engine,
    train_reference,
)

N_IN, HIDDEN, CLASSES, MICRO, STEPS = 7, 13, 5, 2, 3  # odd sizes: padded shards at 2 and 4 ranks
PADDED = {1: 91 + 13 + 65 + 5, 2: 92 + 14 + 66 + 6, 4: 92 + 16 + 68 + 8}  # elements of one model fetch


def _batch(world: int):  # noqa: ANN202
    return lambda step: classification_batch(step, world * MICRO, N_IN, CLASSES)


def _train(all_reduce: bool, world: int, bf16: bool) -> dict:
    import zero_core
    from zero_core import comm

    torch.manual_seed(0)
    model = MLPClassifier(N_IN, HIDDEN, CLASSES)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": {
            "stage": 3,
            "use_all_reduce_for_fetch_params": all_reduce,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), config=config
    )
    batch = _batch(world)
    dtype = torch.bfloat16 if bf16 else torch.float32
    comm.comms_logger.enable()
    comm.comms_logger.reset()
    losses = train_engine(engine, lambda s: (batch(s)[0].to(dtype), batch(s)[1]), STEPS, micro=MICRO)
    ops = {
        op: (comm.comms_logger.count_for(op), comm.comms_logger.bytes_for(op))
        for op in ("all_gather_into_tensor", "all_reduce")
    }
    comm.comms_logger.disable()
    return {"losses": losses, "state": state_snapshot(model, gathered=True), "ops": ops}


def _both(world: int, bf16: bool) -> dict:
    return {"gather": _train(False, world, bf16), "reduce": _train(True, world, bf16)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_reduce_fetch_trains_like_torch_and_like_the_all_gather(world: int) -> None:
    torch.manual_seed(0)
    ref = MLPClassifier(N_IN, HIDDEN, CLASSES)
    ref_losses, ref_state = train_reference(
        ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), _batch(world), STEPS
    )
    for rank, r in enumerate(run_multirank(_both, world, args=(world, False), timeout=240)):
        gather, reduce = r["gather"], r["reduce"]
        assert_trajectory_close(
            reduce["losses"],
            reduce["state"],
            ref_losses,
            ref_state,
            rtol=1e-5,
            atol=1e-6,
            where=f"rank {rank}",
        )
        assert reduce["losses"] == gather["losses"]
        assert_states_equal(reduce["state"], gather["state"], where=f"rank {rank}")
        if world == 1:
            continue  # nothing is communicated
        (g_count, g_bytes), (ar_base, ar_base_bytes) = gather["ops"].values()
        (r_gathers, _), (ar_count, ar_bytes) = reduce["ops"].values()
        # the all-gathers (all fetches: no persistent parameters) became all-reduces, one for one,
        # each of the padded full size of what it fetches (the model is fetched whole each time)
        assert g_count > 0 and r_gathers == 0, (gather["ops"], reduce["ops"])
        assert ar_count - ar_base == g_count, (gather["ops"], reduce["ops"])
        fetched = ar_bytes - ar_base_bytes
        assert fetched > 0 and fetched % (4 * PADDED[world]) == 0, (fetched, PADDED[world])


def test_all_reduce_fetch_is_exact_in_bf16() -> None:
    for r in run_multirank(_both, 2, args=(2, True), timeout=240):
        assert r["reduce"]["losses"] == r["gather"]["losses"]
        assert_states_equal(r["reduce"]["state"], r["gather"]["state"])
        assert r["reduce"]["ops"]["all_gather_into_tensor"][0] == 0


def test_the_key_warns_below_stage_3() -> None:
    from zero_core.config import load_config

    with pytest.warns(UserWarning, match="use_all_reduce_for_fetch_params: applies to stage 3's parameter"):
        load_config(
            {
                "train_batch_size": 2,
                "zero_optimization": {"stage": 1, "use_all_reduce_for_fetch_params": True},
            }
        )
