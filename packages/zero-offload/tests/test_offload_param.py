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
import torch.nn as nn
import torch.nn.functional as F
from zero_core.testing import run_multirank

STEPS = 20
MICRO = 2
SEQ = 8
VOCAB = 32


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.l1 = nn.Linear(16, 23)
        self.l2 = nn.Linear(23, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.l2(torch.tanh(self.l1(h)))
        return F.cross_entropy(self.head(self.norm(h)).reshape(-1, VOCAB), y.reshape(-1))


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    n = world * MICRO
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        loss = model(*_data(step, world))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


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
    from zero_core.zero.stage3 import GatheredParameters

    rank, world = comm.get_rank(), comm.get_world_size()
    from zero_core.zero.stage3 import Init

    torch.manual_seed(0)
    cfg = _config(case, nvme_root)
    if case.get("init"):  # zero.Init places each shard at its home as it is constructed
        with Init(remote_device=case["param"], config_dict_or_path=cfg):
            model = TinyLM()
        placed = [p.zero_state.offload for p in model.parameters()]
        assert all(o is not None and o is placed[0] for o in placed), placed
    else:
        model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = zero_core.initialize(model=model, optimizer=opt, config=cfg)
    if case.get("init"):
        assert {id(o) for o in engine.strategy._param_offloads()} == {id(placed[0])}
    po = engine.strategy._param_offloads()[0]
    losses, memory = [], []
    for step in range(STEPS):
        x, y = _data(step, world)
        engine.backward(engine(x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]))
        engine.step()
        t = torch.tensor([engine.last_loss])
        comm.all_reduce(t)
        losses.append(t.item() / world)
        if step in (0, STEPS - 1):
            memory.append(engine.memory_breakdown())
    with GatheredParameters(list(model.parameters())):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    info = {
        "memory": memory,
        "fetches": po.fetches,
        "read_ahead_hits": po.read_ahead_hits,
        "swap_file": None
        if po.swap_dir is None
        else str(po.swap_dir.path / f"params{len(po._files) - 1}.swp"),
        "shard_numel": {n: p.zero_state.shard_numel for n, p in model.named_parameters()},
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
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=f"losses {case}"
        )
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=f"{k} {case}")
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
            for k in s0:
                torch.testing.assert_close(s0[k], s1[k], rtol=0, atol=0)


def _errors(nvme_root: str) -> dict:
    import zero_core
    from zero_core.zero.stage3 import Init

    out = {}
    cfg = _config(dict(param="nvme", param_opts={"buffer_size": 100, "max_in_cpu": 0}), nvme_root)  # < 512
    model = TinyLM()
    try:
        zero_core.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg)
        out["buffer_size"] = "no error"
    except ValueError as exc:
        out["buffer_size"] = str(exc)
    try:
        with Init(remote_device="nvme"):
            TinyLM()
        out["init"] = "no error"
    except ValueError as exc:
        out["init"] = str(exc)
    # a parameter swap file removed mid-run is reported by name
    cfg = _config(dict(param="nvme", param_opts={"max_in_cpu": 0}), nvme_root)
    model = TinyLM()
    engine, *_ = zero_core.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg)
    po = engine.strategy.param_offload
    victim = po.swap_dir.path / "params0.swp"
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
