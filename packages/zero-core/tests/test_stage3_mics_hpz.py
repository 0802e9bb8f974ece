"""MiCS and ZeRO++ hpZ: exact training, traffic by link class and memory against the formulas.

"2 nodes x 2": 4 forked ranks with ``ZERO_RANKS_PER_NODE=2`` (see [Note: node topology]); the
byte formulas are those of [Note: bytes by link class] and [Note: MiCS and hpZ shard groups].
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank

VOCAB, DIM, SEQ, BATCH, STEPS = 32, 16, 8, 2, 3


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(DIM)
        self.attn = torch.nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.fc1 = torch.nn.Linear(DIM, 4 * DIM)
        self.fc2 = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class TinyLM(torch.nn.Module):
    """The small transformer of test_stage3_parity.py (SGD with momentum: see its docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _batches(world: int, accum: int, steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, accum, world, BATCH, SEQ), generator=g)


def _reference(world: int, accum: int, steps: int) -> tuple[list, dict]:
    """Single-process training on every rank's micro-batches (the mean gradient)."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _batches(world, accum, steps)
    losses = []
    for s in range(steps):
        for a in range(accum):
            step_losses = []
            for r in range(world):
                loss = model(data[s, a, r])
                (loss / (world * accum)).backward()
                step_losses.append(loss.item())
            losses.append(step_losses)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


BASE = {"param_persistence_threshold": 0, "prefetch_bucket_size": 0, "max_reuse_distance": 0}


def _engine(world: int, zero_cfg: dict, accum: int = 1, use_mics_init: bool = False, dtype: str = "fp32"):
    import zero_core

    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, **BASE, **zero_cfg},
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    torch.manual_seed(0)
    if use_mics_init:
        with zero_core.MiCS_Init(config_dict_or_path=cfg):
            model = TinyLM()
    else:
        model = TinyLM()
    engine, *_ = zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), config=cfg
    )
    return engine, model


def _train(world: int, zero_cfg: dict, accum: int = 1, use_mics_init: bool = False) -> tuple:
    """Losses, final weights, step 2's bytes by link class and memory after its backward."""
    import zero_core
    from zero_core import comm
    from zero_core.comm import comms_logger
    from zero_core.zero.stage3.partitioned_param import set_collective_checks

    rank = comm.get_rank()
    set_collective_checks(False)  # its 32-byte headers would blur the byte counts
    engine, model = _engine(world, zero_cfg, accum, use_mics_init)
    data = _batches(world, accum, STEPS)
    losses, links, memory = [], None, None
    for s in range(STEPS):
        if s == 1:
            comms_logger.reset()
            comms_logger.enable()
        for a in range(accum):
            loss = engine(data[s, a, rank])
            engine.backward(loss)
            if s == 1 and a == accum - 1:
                memory = engine.strategy.memory_breakdown()
            engine.step()
            losses.append(loss.item())
        if s == 1:
            comms_logger.disable()
            links = comms_logger.bytes_by_link()
    set_collective_checks(True)
    state = {}
    for name, p in model.named_parameters():
        with zero_core.GatheredParameters([p]):
            state[name] = p.detach().clone()
    return losses, state, links, memory


def _jobs(world: int, jobs: list[tuple]) -> list:
    return [_train(world, *job) for job in jobs]


def _check_exact(ref: tuple, got: list, world: int) -> None:
    ref_losses, ref_state = ref
    for r in range(world):
        losses, state, *_ = got[r]
        for i, step_losses in enumerate(ref_losses):
            assert losses[i] == pytest.approx(step_losses[r], rel=1e-5), (r, i)
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], rtol=1e-5, atol=1e-6, msg=k)


def _psi_bytes() -> int:
    return sum(p.numel() for p in TinyLM().parameters()) * 4


FOUR = {
    "plain": ({}, 1, False),
    "mics2": ({"mics_shard_size": 2}, 1, False),
    "mics4_hier": ({"mics_shard_size": 4, "mics_hierarchical_params_gather": True}, 1, True),
    "hpz2": ({"zero_hpz_partition_size": 2}, 1, False),
    "hpz2_accum": ({"zero_hpz_partition_size": 2}, 2, False),
}


def test_mics_hpz_four_ranks_two_nodes() -> None:
    """Trajectories, cross-node bytes and memory of MiCS and hpZ on 2 nodes x 2 ranks."""
    names = list(FOUR)
    got = run_multirank(
        _jobs, 4, args=(4, [FOUR[n] for n in names]), timeout=240, env={"ZERO_RANKS_PER_NODE": "2"}
    )
    res = {n: [g[i] for g in got] for i, n in enumerate(names)}
    ref1 = _reference(4, 1, STEPS)
    for n in names:
        _check_exact(_reference(4, 2, STEPS) if n.endswith("accum") else ref1, res[n], 4)

    psi = _psi_bytes()
    # Per rank and step (fp32, N=4, L=2): plain sends its 3 collectives' (N-L)/N across nodes.
    expected_inter = {
        "plain": 3 * psi * 2 / 4,
        "hpz2": 2 * psi * 2 / 4,  # the backward all-gather stays in the node
        "mics2": 2 * (psi / 2) / 2,  # only the replica all-reduce of the 1/S gradient shard
        "mics4_hier": 2 * (psi / 4) + psi * 2 / 4,  # hop 1 of both gathers + the reduce-scatter
    }
    for n, want in expected_inter.items():
        for r in range(4):
            inter = res[n][r][2]["inter_node"]
            assert inter == pytest.approx(want, rel=0.05), (n, r, inter, want)
    # MiCS inside a node: nothing but the replica all-reduce leaves it; ratios the issue asks for
    assert res["mics2"][0][2]["inter_node"] < res["plain"][0][2]["inter_node"] / 2.5
    assert res["hpz2"][0][2]["inter_node"] == pytest.approx(
        res["plain"][0][2]["inter_node"] * 2 / 3, rel=0.05
    )

    # Memory: fp32 shards are the masters; MiCS holds N/S times plain's; hpZ adds Ψ/H.
    plain = res["plain"][0][3]["parameters"]
    assert plain == pytest.approx(psi / 4, rel=0.05)
    assert res["mics2"][0][3]["parameters"] == pytest.approx(2 * plain, rel=0.05)
    assert res["mics4_hier"][0][3]["parameters"] == pytest.approx(plain, rel=0.05)
    assert res["hpz2"][0][3]["parameters"] == pytest.approx(plain, rel=0.05)
    assert res["hpz2"][0][3]["secondary_parameters"] == pytest.approx(psi / 2, rel=0.05)
    assert res["plain"][0][3].get("secondary_parameters", 0) == 0


def _checkpoint_roundtrip(tmp: str) -> list:
    """MiCS saves, plain stage 3 loads, trains on; and back: the same as training straight on."""
    from zero_core import comm

    rank = comm.get_rank()
    data = _batches(4, 1, 4)

    def run(engine, steps):
        out = []
        for s in steps:
            loss = engine(data[s, 0, rank])
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    mics = {"mics_shard_size": 2}
    a, _ = _engine(4, mics)
    first = run(a, [0, 1])
    a.save_checkpoint(tmp, tag="mics")
    straight = run(a, [2, 3])
    b, _ = _engine(4, {})
    b.load_checkpoint(tmp, tag="mics")
    via_plain = run(b, [2])
    b.save_checkpoint(tmp, tag="plain")
    c, _ = _engine(4, {"zero_hpz_partition_size": 2})
    c.load_checkpoint(tmp, tag="plain")
    via_hpz = run(c, [3])
    return first, straight, via_plain + via_hpz


def test_checkpoint_reshards_between_mics_hpz_and_plain(tmp_path) -> None:
    got = run_multirank(
        _checkpoint_roundtrip, 4, args=(str(tmp_path),), timeout=240, env={"ZERO_RANKS_PER_NODE": "2"}
    )
    for _first, straight, resumed in got:
        assert resumed == pytest.approx(straight, rel=1e-5)


def _two_ranks() -> list:
    return _jobs(
        2,
        [
            ({"mics_shard_size": 2, "mics_hierarchical_params_gather": True}, 1, False),
            ({"mics_shard_size": 1}, 2, False),
            ({"zero_hpz_partition_size": 2}, 1, False),
        ],
    )


def test_mics_hpz_two_ranks() -> None:
    """2 nodes x 1: a two-hop gather across nodes, MiCS as pure replication, hpZ over both ranks."""
    got = run_multirank(_two_ranks, 2, timeout=180, env={"ZERO_RANKS_PER_NODE": "1"})
    _check_exact(_reference(2, 1, STEPS), [g[0] for g in got], 2)
    _check_exact(_reference(2, 2, STEPS), [g[1] for g in got], 2)
    _check_exact(_reference(2, 1, STEPS), [g[2] for g in got], 2)


def _bad(cfg: dict) -> str:
    try:
        _engine(4, cfg)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_invalid_layouts_fail_at_initialize() -> None:
    cases = [
        {"mics_shard_size": 3},
        {"zero_hpz_partition_size": 3},
        {"mics_shard_size": 2, "zero_hpz_partition_size": 2},
        {"mics_shard_size": 3 * 2, "mics_hierarchical_params_gather": True},
    ]
    got = run_multirank(lambda: [_bad(c) for c in cases], 4, timeout=120, env={"ZERO_RANKS_PER_NODE": "2"})
    msgs = got[0]
    assert "mics_shard_size=3 does not divide" in msgs[0]
    assert "zero_hpz_partition_size=3 does not divide" in msgs[1]
    assert "cannot be combined" in msgs[2]
    assert "does not divide" in msgs[3]
    with pytest.raises(ValueError, match="MiCS needs stage 3"):
        from zero_core.config import load_config

        load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2, "mics_shard_size": 2}})
