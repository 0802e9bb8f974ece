"""MiCS and ZeRO++ hpZ: exact training, traffic by link class and memory against the formulas.

"2 nodes x 2": 4 forked ranks with ``ZERO_RANKS_PER_NODE=2`` (see [Note: node topology]); the
byte formulas are those of [Note: bytes by link class] and [Note: MiCS and hpZ shard groups].
"""

from __future__ import annotations

import functools

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import BlockLM

VOCAB, DIM, SEQ, BATCH, STEPS = 32, 16, 8, 2, 3


def _batches(world: int, accum: int, steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, accum, world, BATCH, SEQ), generator=g)


@functools.cache
def _reference(world: int, accum: int, steps: int, clip: float = 0.0) -> tuple[list, dict]:
    """Single-process training on every rank's micro-batches (the mean gradient)."""
    torch.manual_seed(0)
    model = BlockLM(2, VOCAB, DIM)
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
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


BASE = {"param_persistence_threshold": 0, "prefetch_bucket_size": 0, "max_reuse_distance": 0}


def _engine(
    world: int,
    zero_cfg: dict,
    accum: int = 1,
    use_mics_init: bool = False,
    dtype: str = "fp32",
    clip: float = 0.0,
):
    import zero_core

    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 3, **BASE, **zero_cfg},
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    torch.manual_seed(0)
    if use_mics_init:
        init = zero_core.MiCS_Init if "mics_shard_size" in zero_cfg else zero_core.Init
        with init(config_dict_or_path=cfg):
            model = BlockLM(2, VOCAB, DIM)
    else:
        model = BlockLM(2, VOCAB, DIM)
    engine, *_ = zero_core.initialize(
        model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), config=cfg
    )
    return engine, model


def _train(
    world: int,
    zero_cfg: dict,
    accum: int = 1,
    use_mics_init: bool = False,
    dtype: str = "fp32",
    clip: float = 0.0,
) -> tuple:
    """Losses, final weights, step 2's bytes by link class and memory after its backward."""
    import zero_core
    from zero_core import comm
    from zero_core.comm import comms_logger
    from zero_core.zero.stage3.partitioned_param import set_collective_checks

    rank = comm.get_rank()
    set_collective_checks(False)  # its 32-byte headers would blur the byte counts
    engine, model = _engine(world, zero_cfg, accum, use_mics_init, dtype, clip)
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
            state[name] = p.detach().float().clone()
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
    return sum(p.numel() for p in BlockLM(2, VOCAB, DIM).parameters()) * 4


# name -> (zero_cfg, accum, build under zero.MiCS_Init / zero.Init, dtype, gradient_clipping)
FOUR = {
    "plain": ({}, 1, False, "fp32", 0.0),
    "mics2": ({"mics_shard_size": 2}, 1, False, "fp32", 0.0),
    "mics4_hier": ({"mics_shard_size": 4, "mics_hierarchical_params_gather": True}, 1, True, "fp32", 0.0),
    "hpz2": ({"zero_hpz_partition_size": 2}, 1, False, "fp32", 0.0),
    "hpz2_accum": ({"zero_hpz_partition_size": 2}, 2, False, "fp32", 0.0),
    "hpz2_init": ({"zero_hpz_partition_size": 2}, 1, True, "fp32", 0.0),  # built under zero.Init
    "mics2_clip": ({"mics_shard_size": 2}, 1, False, "fp32", 0.1),
    "hpz2_clip": ({"zero_hpz_partition_size": 2}, 1, False, "fp32", 0.1),
}
LOW = {  # 16-bit: compared with plain stage 3 in the same precision
    f"{name}_{dtype}": (cfg, 1, False, dtype, 0.0)
    for dtype in ("bf16", "fp16")
    for name, cfg in (
        ("plain", {}),
        ("mics2", {"mics_shard_size": 2}),
        ("hpz2", {"zero_hpz_partition_size": 2}),
    )
}
INVALID = [
    {"mics_shard_size": 3},
    {"zero_hpz_partition_size": 3},
    {"mics_shard_size": 2, "zero_hpz_partition_size": 2},
]


def _bad(cfg: dict) -> str:
    try:
        _engine(4, cfg)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _modifier() -> list:
    """GatheredParameters(modifier_rank=3) under MiCS: every replica takes rank 3's value."""
    import zero_core
    from zero_core import comm

    _, model = _engine(4, {"mics_shard_size": 2})
    w = model.head.weight
    with zero_core.GatheredParameters([w], modifier_rank=3):
        if comm.get_rank() == 3:
            w.data.fill_(0.25)
    with zero_core.GatheredParameters([w]):
        return w.detach().flatten()[:4].tolist()


def _checkpoint_roundtrip(tmp: str) -> list:
    """MiCS saves, plain stage 3 loads and trains, saves; hpZ and MiCS load: as if trained straight on."""
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

    a, _ = _engine(4, {"mics_shard_size": 2})
    run(a, [0, 1])
    a.save_checkpoint(tmp, tag="mics")
    straight = run(a, [2, 3])
    b, _ = _engine(4, {})
    b.load_checkpoint(tmp, tag="mics")
    via_plain = run(b, [2])
    b.save_checkpoint(tmp, tag="plain")
    c, _ = _engine(4, {"zero_hpz_partition_size": 2})
    c.load_checkpoint(tmp, tag="plain")
    d, _ = _engine(4, {"mics_shard_size": 4, "mics_hierarchical_params_gather": True})
    d.load_checkpoint(tmp, tag="plain")
    return [straight, via_plain + run(c, [3]), run(d, [3])]


def _four(tmp: str) -> dict:
    """Every 4-rank case in one launch (launches dominate the time of these tests)."""
    cases = {**FOUR, **LOW}
    return {
        "train": {n: _train(4, *cases[n]) for n in cases},
        "invalid": [_bad(c) for c in INVALID],
        "modifier": _modifier(),
        "checkpoint": _checkpoint_roundtrip(tmp),
    }


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list:
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    return run_multirank(_four, 4, args=(tmp,), timeout=400, env={"ZERO_RANKS_PER_NODE": "2"})


def _res(four: list, name: str) -> list:
    return [g["train"][name] for g in four]


def test_mics_hpz_trajectories_equal_single_process(four) -> None:
    """fp32, with MiCS_Init, hierarchical gather, accumulation and clipping: exact."""
    for n, (_cfg, accum, _init, _dtype, clip) in FOUR.items():
        _check_exact(_reference(4, accum, STEPS, clip), _res(four, n), 4)


def test_mics_hpz_bf16_fp16_follow_plain_stage3(four) -> None:
    for dtype in ("bf16", "fp16"):
        plain = _res(four, f"plain_{dtype}")
        for name in ("mics2", "hpz2"):
            got = _res(four, f"{name}_{dtype}")
            for r in range(4):
                assert got[r][0] == pytest.approx(plain[r][0], rel=2e-2), (name, dtype, r)


def test_cross_node_bytes_per_step_match_the_formulas(four) -> None:
    """Per rank and step (fp32, N=4 ranks, L=2 per node): [Note: bytes by link class]."""
    psi = _psi_bytes()
    expected_inter = {
        "plain": 3 * psi * 2 / 4,  # three collectives of Ψ, each sending (N-L)/N across
        "hpz2": 2 * psi * 2 / 4,  # the backward all-gather stays in the node
        "mics2": 2 * (psi / 2) / 2,  # only the replica all-reduce of the 1/S gradient shard
        "mics4_hier": 2 * (psi / 4) + psi * 2 / 4,  # hop 1 of both gathers + the reduce-scatter
    }
    for n, want in expected_inter.items():
        for r, res in enumerate(_res(four, n)):
            inter = res[2]["inter_node"]
            assert inter == pytest.approx(want, rel=0.05), (n, r, inter, want)
    plain = _res(four, "plain")[0][2]["inter_node"]
    assert _res(four, "hpz2")[0][2]["inter_node"] == pytest.approx(plain * 2 / 3, rel=0.05)
    assert _res(four, "mics2")[0][2]["inter_node"] == pytest.approx(plain / 3, rel=0.05)


def test_memory_per_rank_matches_the_formulas(four) -> None:
    """fp32 shards are the masters; MiCS holds N/S times plain's states; hpZ adds Ψ/H."""
    psi = _psi_bytes()
    plain = _res(four, "plain")[0][3]
    assert plain["parameters"] == pytest.approx(psi / 4, rel=0.05)
    assert plain.get("secondary_parameters", 0) == 0
    for name, factor in (("mics2", 2), ("mics4_hier", 1), ("hpz2", 1)):
        mem = _res(four, name)[0][3]
        for key in ("parameters", "gradients", "optimizer_states"):
            assert mem[key] == pytest.approx(factor * plain[key], rel=0.05), (name, key)
    assert _res(four, "hpz2")[0][3]["secondary_parameters"] == pytest.approx(psi / 2, rel=0.05)


def test_invalid_layouts_fail_at_initialize(four) -> None:
    msgs = four[0]["invalid"]
    assert "mics_shard_size=3 does not divide the data-parallel world size 4" in msgs[0]
    assert "zero_hpz_partition_size=3 does not divide" in msgs[1]
    assert "cannot be combined" in msgs[2]
    from zero_core.config import load_config

    with pytest.raises(ValueError, match="MiCS needs stage 3"):
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2, "mics_shard_size": 2}})
    with pytest.raises(ValueError, match="hpZ"):
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": 1, "zero_hpz_partition_size": 2}})


def test_gathered_parameters_modifier_reaches_every_replica(four) -> None:
    for g in four:
        assert g["modifier"] == [0.25] * 4


def test_checkpoint_reshards_between_mics_hpz_and_plain(four) -> None:
    for straight, resumed, mics_resumed in (g["checkpoint"] for g in four):
        assert resumed == pytest.approx(straight, rel=1e-5)
        assert mics_resumed == pytest.approx(straight[1:], rel=1e-5)


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
