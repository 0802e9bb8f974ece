"""Stage-3 parameter offload (cpu, nvme) trains exactly like single-process PyTorch, off the device.

Every case runs 20 fp32 steps and is compared with plain PyTorch (1e-5 relative), with and
without optimizer offload, at world sizes 1 and 2; all cases of a world size share one launch.
Small ``buffer_size`` / ``buffer_count`` / ``max_in_cpu`` make the NVMe path really stream
(several shards per step through a 2-4 buffer pool, some shards kept in CPU memory). The memory
case checks where the bytes are: no device copy of an offloaded shard outside a gather, host
homes for ``cpu``, and at most ``buffer_count x buffer_size (+ max_in_cpu)`` elements of CPU
memory for ``nvme``.
"""

from __future__ import annotations

import os

import pytest
import torch
from zero_core.testing import parity, run_multirank
from zero_core.testing.models import TinyLM, token_batch
from zero_core.zero.stage3.param_records import partition_state
from zero_offload import ParamOffload

STEPS, MICRO, SEQ, VOCAB = 20, 2, 8, 32


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(1000 + step, world * MICRO, SEQ, VOCAB)


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyLM(VOCAB, 16, 23)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return parity.train_reference(model, opt, lambda step: _data(step, world), STEPS)


def _config(case: dict, nvme_root: str) -> dict:
    param = {"device": case["param"], **case.get("param_opts", {})}
    if case["param"] == "nvme":
        param["nvme_path"] = nvme_root
    zc = {
        "stage": 3,
        "sub_group_size": 1000,
        "param_persistence_threshold": case.get("persist", 0),
        "offload_param": param,
    }
    if case.get("opt"):
        zc["offload_optimizer"] = {"device": case["opt"]}
        if case["opt"] == "nvme":
            zc["offload_optimizer"].update(nvme_path=nvme_root, pipeline_read=True, pipeline_write=True)
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": zc,
    }


def _train(case: dict, nvme_root: str) -> tuple:
    import zero_core
    from zero_core import comm
    from zero_core.zero.stage3 import Init

    world = comm.get_world_size()
    torch.manual_seed(0)
    cfg = _config(case, nvme_root)
    if case.get("init"):  # zero.Init places each shard at its home as it is constructed
        with Init(remote_device=case["param"], config_dict_or_path=cfg):
            model = TinyLM(VOCAB, 16, 23)
        placed = [partition_state(p).store for p in model.parameters()]
        assert all(isinstance(o, ParamOffload) and o is placed[0] for o in placed), placed
    else:
        model = TinyLM(VOCAB, 16, 23)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = zero_core.initialize(model=model, optimizer=opt, config=cfg)
    if case.get("init"):
        assert {id(o) for o in engine.strategy.shard_stores()} == {id(placed[0])}
    (po,) = [s for s in engine.strategy.shard_stores() if isinstance(s, ParamOffload)]
    memory = []

    def record_memory(step: int) -> None:
        if step in (0, STEPS - 1):
            memory.append(engine.memory_breakdown())

    losses = parity.train_engine(
        engine, lambda step: _data(step, world), STEPS, micro=MICRO, after_step=record_memory
    )
    state = parity.state_snapshot(model, gathered=True)
    info = {
        "memory": memory,
        "fetches": po.fetches,
        "read_ahead_hits": po.read_ahead_hits,
        "swap_file": None if po.swap_dir is None else str(po.swap_dir.path / list(po.swap_dir.files)[-1]),
        "shard_numel": {n: partition_state(p).shard_numel for n, p in model.named_parameters()},
    }
    info["swap_file_existed"] = info["swap_file"] is not None and os.path.exists(info["swap_file"])
    engine.destroy()
    info["swap_removed"] = info["swap_file"] is None or not os.path.exists(info["swap_file"])
    return losses, state, info


def _run_cases(cases: list[dict], nvme_root: str) -> list:
    return [_train(c, nvme_root) for c in cases]


NVME_SMALL = {"buffer_count": 3, "buffer_size": 1024, "max_in_cpu": 300}
CASES = [
    dict(param="cpu"),
    dict(param="cpu", opt="cpu", persist=40),
    dict(param="nvme", param_opts=NVME_SMALL),
    dict(param="nvme", opt="cpu", param_opts={"buffer_count": 2, "buffer_size": 1024, "max_in_cpu": 0}),
    dict(param="nvme", opt="nvme", param_opts=NVME_SMALL),
    dict(param="nvme", init=True, param_opts=NVME_SMALL),
    dict(param="cpu", init=True, opt="cpu"),
]


@pytest.mark.parametrize("world", [1, 2])
def test_offload_param_matches_single_process_torch(world: int, tmp_path) -> None:
    results = run_multirank(_run_cases, world, args=(CASES, str(tmp_path)), timeout=240)
    ref_losses, ref_state = _reference(world)
    for case, (losses, state, info) in zip(CASES, results[0]):
        parity.assert_trajectory_close(
            losses, state, ref_losses, ref_state, rtol=1e-5, atol=1e-6, where=f"{case}"
        )
        assert info["fetches"] > 0, case
        shard_elems = sum(info["shard_numel"].values())
        for bd in info["memory"]:
            # No device copy of an offloaded shard outside a gather.
            assert bd["offloaded_parameters_device"] == 0, (case, bd)
            assert bd["parameters"] <= 4 * 40, (case, bd)  # at most the non-offloaded persistent ones
            if case["param"] == "cpu":
                assert bd["host_parameters"] == 4 * shard_elems, (case, bd)
                assert bd["host_param_swap_buffers"] == 0 and bd["nvme_parameters"] == 0, (case, bd)
            else:
                opts = case["param_opts"]
                assert bd["nvme_parameters"] >= 4 * (shard_elems - opts["max_in_cpu"]), (case, bd)
                assert bd["host_parameters"] <= 4 * opts["max_in_cpu"], (case, bd)
                assert bd["host_param_swap_buffers"] <= opts["buffer_count"] * opts["buffer_size"] * 4, (
                    case,
                    bd,
                )
        if case["param"] == "nvme":
            assert info["swap_file_existed"] and info["read_ahead_hits"] > 0, (case, info)
        assert info["swap_removed"], case
    for other in results[1:]:
        for (_, s0, _), (_, s1, _) in zip(results[0], other):
            parity.assert_states_equal(s1, s0)


def _errors(nvme_root: str) -> dict:
    import zero_core
    from zero_core.zero.stage3 import Init

    out = {}
    cfg = _config(dict(param="nvme", param_opts={"buffer_size": 100, "max_in_cpu": 0}), nvme_root)  # < 512
    model = TinyLM(VOCAB, 16, 23)
    try:
        zero_core.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg)
        out["buffer_size"] = "no error"
    except ValueError as exc:
        out["buffer_size"] = str(exc)
    try:
        with Init(remote_device="nvme"):
            TinyLM(VOCAB, 16, 23)
        out["init"] = "no error"
    except ValueError as exc:
        out["init"] = str(exc)
    # a parameter swap file removed mid-run is reported by name
    cfg = _config(dict(param="nvme", param_opts={"max_in_cpu": 0}), nvme_root)
    model = TinyLM(VOCAB, 16, 23)
    engine, *_ = zero_core.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg)
    po = engine.strategy.param_offload
    victim = po.swap_dir.path / next(iter(po.swap_dir.files))  # its first parameter swap file
    os.remove(victim)
    x, y = _data(0, 1)
    try:
        engine.backward(engine(x[:MICRO], y[:MICRO]))
        out["removed"] = "no error"
    except OSError as exc:
        out["removed"] = f"{victim}|{exc}"
    engine.destroy()
    return out


def test_offload_param_clear_errors(tmp_path) -> None:
    (out,) = run_multirank(_errors, 1, args=(str(tmp_path),), timeout=60)
    assert "offload_param.buffer_size is 100" in out["buffer_size"], out
    assert "remote_device='nvme'" in out["init"] and "offload_param" in out["init"], out
    victim, msg = out["removed"].split("|", 1)
    assert victim in msg and "disappeared" in msg, out
