"""ZeRO++ qwZ (``zero_quantized_weights``) and qgZ (``zero_quantized_gradients``) under stage 3.

World sizes 2 and 4; 4 runs as "2 nodes x 2" (``ZERO_RANKS_PER_NODE=2``) so that qgZ takes
both hops. What is checked: the quantized reduce-scatter hands every rank its own row summed
(the plain reduce-scatter's layout) within the int4 block bound; the bytes each collective
moves per step against the formulas (qwZ halves the forward all-gather of 16-bit weights, the
backward one is unchanged; qgZ sends a quarter of the 16-bit gradient volume inside the node and
``nodes / N`` of that across); training stays within 2% of plain stage 3; GatheredParameters,
checkpoints (the plain stage-3 format) and the fp32 masters stay full precision.
"""

from __future__ import annotations

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.zero.stage3.param_records import partition_state

TWO_NODES = {"ZERO_RANKS_PER_NODE": "2"}


# -- the quantized reduce-scatter itself ------------------------------------------------------
def _rows(rank: int, n: int, s: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, s, generator=g) * torch.logspace(-2, 1, s)


def _qrs_check(s: int) -> dict:
    from zero_core import comm
    from zero_core.comm.quantize import QMAX
    from zero_core.comm.quantized_collectives import GRAD_BLOCK, QgzReducer

    rank, n = comm.get_rank(), comm.get_world_size()
    rows = _rows(rank, n, s)
    out = torch.empty(s)
    reducer = QgzReducer(None)
    comm.comms_logger.enable()
    reducer(out, rows, None).wait()
    comm.comms_logger.disable()
    every = [_rows(r, n, s)[rank] for r in range(n)]
    exact = torch.stack(every).sum(0)
    # bound: each rank's own int4 rounding, then (two hops) the rounding of each node's partial sum
    cols = -(-s // GRAD_BLOCK) * GRAD_BLOCK

    def block_absmax(v: torch.Tensor) -> torch.Tensor:
        p = torch.zeros(cols)
        p[:s] = v.abs()
        return p.view(-1, GRAD_BLOCK).amax(1).repeat_interleave(GRAD_BLOCK)[:s]

    step = 2 * QMAX[4]
    bound = sum(block_absmax(v) for v in every) / step
    if reducer.hierarchical:
        bound = bound + 2 * sum(block_absmax(v) for v in every) / step
    err = (out - exact).abs()
    stats = comm.comms_logger.summary()
    return {
        "hier": reducer.hierarchical,
        "within": bool((err <= bound + 1e-6).all()),
        "nonzero": float(err.max()) > 0,
        "rel": float(err.norm() / exact.norm()),
        "bytes": {str(k[1]): v.bytes for k, v in stats.items() if k[0] == "all_to_all_single"},
    }


@pytest.mark.parametrize("world,env", [(2, None), (4, TWO_NODES)])
def test_quantized_reduce_scatter_layout_and_bound(world, env):
    s = 1000  # not a multiple of the block: rows are padded to whole blocks
    res = run_multirank(_qrs_check, world, args=(s,), env=env, timeout=180)
    for r in res:
        assert r["hier"] == (world == 4)
        assert r["within"] and r["nonzero"]
        # int4: a step is 1/7 of the block absmax; independent random rows are the worst case
        assert r["rel"] < (0.35 if r["hier"] else 0.2)
    cols = 1024
    q_row = cols // 2 + 4 * cols // 256  # int4 payload + fp32 scales of one padded row
    if world == 2:  # one hop over the whole group
        assert res[0]["bytes"] == {"(0, 1)": world * q_row}
    else:  # 2 nodes x 2: N rows inside the node, then one row per node across
        assert res[0]["bytes"] == {"(0, 1)": 4 * q_row, "(0, 2)": 2 * q_row}
        assert res[3]["bytes"] == {"(2, 3)": 4 * q_row, "(1, 3)": 2 * q_row}


# -- training -----------------------------------------------------------------------------------
D, MICRO = 256, 16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(D, D, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(D, 8, bias=False))


def _config(q: dict, dtype: str = "bf16", top: dict | None = None) -> dict:
    cfg = {
        **(top or {}),
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            **q,
        },
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def _batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh samples of a fixed linear map (a teacher), so the loss stays well above zero."""
    teacher = torch.randn(D, 8, generator=torch.Generator().manual_seed(7)) / D**0.5
    x = torch.randn(MICRO, D, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x.to(dtype), x @ teacher


def _losses(q: dict, dtype: str, steps: int, top: dict) -> list[float]:
    import zero_core
    from zero_core import comm

    engine, *_ = zero_core.initialize(model=_model(), config=_config(q, dtype, top))
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    out = []
    for step in range(steps):
        x, y = _batch(step, comm.get_rank(), tdtype)
        loss = (engine(x).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()  # an optimizer step at each accumulation boundary
        mean = loss.detach().clone()
        comm.all_reduce(mean)
        out.append(float(mean) / comm.get_world_size())
    return out


QW = {"zero_quantized_weights": True}
QG = {"zero_quantized_gradients": True}
BOTH = {**QW, **QG}


def _all_losses(dtype: str, steps: int, top: dict, names: tuple[str, ...]) -> dict[str, list[float]]:
    return {name: _losses(VARIANTS[name], dtype, steps, top) for name in names}


VARIANTS = {
    "plain": {},
    "qwZ": QW,
    "qgZ": QG,
    "qwZ+qgZ": BOTH,
    # every switch together: ZeRO++ (hpZ + qwZ + qgZ), and MiCS with both quantizers
    "ZeRO++": {"zero_hpz_partition_size": 2, **BOTH},
    "MiCS+qwZ+qgZ": {"mics_shard_size": 2, **BOTH},
}


ALL = ("plain", "qwZ", "qgZ", "qwZ+qgZ")


@pytest.mark.parametrize(
    "world,env,dtype,top,names",
    [
        (2, None, "bf16", {}, ALL),
        (4, TWO_NODES, "bf16", {"gradient_clipping": 0.5, "gradient_accumulation_steps": 2}, tuple(VARIANTS)),
        (2, None, "fp16", {}, ("plain", "qwZ+qgZ")),
        (2, None, "fp32", {}, ("plain", "qwZ+qgZ")),
    ],
)
def test_training_tracks_plain_stage3(world, env, dtype, top, names):
    """Every logged loss within 2% of plain stage 3's, each switch alone and both together.

    fp32 training is supported: the weights travel int8 instead of fp32 (a quarter of the bytes).
    """
    res = run_multirank(_all_losses, world, args=(dtype, 12, top, names), env=env, timeout=300)[0]
    plain = res.pop("plain")
    assert sum(plain[-3:]) < 0.9 * sum(plain[:3])  # it learns
    for name, got in res.items():
        worst = max(abs(a - b) / b for a, b in zip(got, plain))
        assert worst < 0.02, (name, worst, got, plain)
        assert got != plain  # the switch changed what travelled


# -- bytes per step against the formulas --------------------------------------------------------
def _step_bytes(q: dict) -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.zero.stage3.partitioned_param import set_collective_checks

    set_collective_checks(False)  # only the data collectives in the counts
    cfg = _config(q, "bf16")
    # no prefetch: backward's gathers then happen in backward, not during forward
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    engine, *_ = zero_core.initialize(model=_model(), config=cfg)
    log = comm.comms_logger
    out = {}
    for step in range(2):  # the second step follows the recorded trace (prefetching)
        x, y = _batch(step, comm.get_rank(), torch.bfloat16)
        log.reset()
        log.enable()
        loss = (engine(x).float() - y).pow(2).mean()
        out["fwd_ag"] = log.bytes_for("all_gather_into_tensor")
        engine.backward(loss)
        engine.step()
        log.disable()
        out["bwd_ag"] = log.bytes_for("all_gather_into_tensor") - out["fwd_ag"]
        out["rs"] = log.bytes_for("reduce_scatter_tensor")
        out["a2a"] = {str(k[1]): v.bytes for k, v in log.summary().items() if k[0] == "all_to_all_single"}
    set_collective_checks(True)
    return out


def _bytes_of_each() -> list[dict]:
    return [_step_bytes(q) for q in ({}, QW, QG)]


@pytest.mark.parametrize("world,env", [(2, None), (4, TWO_NODES)])
def test_bytes_per_step_match_the_formulas(world, env):
    """bf16, Ψ weights: plain stage 3 gathers 2Ψ bytes in forward and again in backward and
    reduce-scatters 2Ψ. qwZ: forward ~Ψ (int8 + a 4-byte scale per 256), backward 2Ψ. qgZ: no
    reduce-scatter; Ψ/2 (int4) inside the node and, with 2 nodes x 2, Ψ/2 x nodes/N across."""
    psi = 3 * D * D + D * 8
    plain, qw, qg = run_multirank(_bytes_of_each, world, env=env, timeout=300)[0]
    assert plain["fwd_ag"] == plain["bwd_ag"] == plain["rs"] == 2 * psi
    assert plain["a2a"] == {}
    assert abs(qw["fwd_ag"] / plain["fwd_ag"] - 0.5) <= 0.05 * 0.5
    assert qw["bwd_ag"] == plain["bwd_ag"] and qw["rs"] == plain["rs"]
    assert qg["rs"] == 0 and qg["fwd_ag"] == qg["bwd_ag"] == 2 * psi
    if world == 2:  # one node: one hop
        assert set(qg["a2a"]) == {"(0, 1)"}
        assert abs(qg["a2a"]["(0, 1)"] / plain["rs"] - 0.25) <= 0.05 * 0.25
        return
    intra, inter = qg["a2a"]["(0, 1)"], qg["a2a"]["(0, 2)"]
    assert abs(intra / plain["rs"] - 0.25) <= 0.05 * 0.25
    assert abs(inter / plain["rs"] - 0.25 * 2 / 4) <= 0.05 * 0.25 * 2 / 4


# -- full precision where it must be ----------------------------------------------------------
def _full_precision_checks(tmp: str) -> dict:
    import zero_core
    from zero_core import comm

    rank = comm.get_rank()
    engine, *_ = zero_core.initialize(model=_model(), config=_config(BOTH, "bf16"))
    seen = {}
    first = engine.module[0]
    first.register_forward_hook(lambda m, i, o: seen.__setitem__("fwd", m.weight.detach().clone()))
    for step in range(2):
        x, y = _batch(step, rank, torch.bfloat16)
        engine.backward((engine(x).float() - y).pow(2).mean())
        engine.step()
    x, _ = _batch(5, rank, torch.bfloat16)
    engine(x)
    st = partition_state(first.weight)
    exact = torch.empty(st.padded_numel, dtype=st.shard.dtype)
    comm.all_gather_into_tensor(exact, st.shard)
    exact = exact[: st.numel].view(st.shape)
    master = engine.strategy.master[st.id]
    with zero_core.GatheredParameters([first.weight]):
        gathered = first.weight.detach().clone()
    fwd = seen["fwd"].float()
    err = (fwd - exact.float()).abs().max()
    # int8 rounding (absmax / 254 per block) plus bf16's rounding of the dequantized value
    bound = exact.float().abs().max() * (1 / 254 + 2**-8)
    engine.save_checkpoint(tmp, tag="q")
    # the checkpoint is plain stage 3's: a plain engine loads it and holds the same weights
    plain, *_ = zero_core.initialize(model=_model(), config=_config({}, "bf16"))
    plain.load_checkpoint(tmp, tag="q")
    with zero_core.GatheredParameters([plain.module[0].weight]):
        reloaded = plain.module[0].weight.detach().clone()
    return {
        "gathered_exact": torch.equal(gathered, exact),
        "fwd_quantized": (bool(err > 0) and bool(err <= bound)) or (float(err), float(bound)),
        "master_fp32": master.dtype == torch.float32
        and torch.equal(master.detach().to(st.shard.dtype), st.shard),
        "reloaded": torch.equal(reloaded, exact),
    }


def test_gathered_parameters_masters_and_checkpoints_stay_full_precision(tmp_path):
    for r in run_multirank(_full_precision_checks, 2, args=(str(tmp_path),), timeout=240):
        assert r == {"gathered_exact": True, "fwd_quantized": True, "master_fp32": True, "reloaded": True}


def _init_and_frozen() -> dict:
    import zero_core
    from zero_core import comm

    cfg = _config({**BOTH, "zero_quantized_nontrainable_weights": True}, "bf16")
    with zero_core.Init(config_dict_or_path=cfg):
        model = _model()
    frozen = model[0].weight
    frozen.requires_grad_(False)  # stored int8, gathered int8 in forward and backward
    with zero_core.GatheredParameters([frozen]):
        before = frozen.detach().clone().to(torch.bfloat16)
    engine, *_ = zero_core.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg
    )
    st = partition_state(frozen)
    losses = []
    for step in range(6):
        x, y = _batch(step, comm.get_rank(), torch.bfloat16)
        loss = (engine(x).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    with zero_core.GatheredParameters([frozen]):
        after = frozen.detach().clone()
    err = (after.float() - before.float()).abs().max()
    return {
        "losses": losses,
        "shard_bytes": st.shard.untyped_storage().nbytes(),
        "quantized_bytes": engine.strategy.memory_breakdown().get("quantized_parameters"),
        "shard_numel": st.shard_numel,
        "stored_quantized": bool(err > 0)
        and float(err) <= float(before.float().abs().max()) * (1 / 254 + 2**-8),
    }


def test_zero_init_and_frozen_weights_stored_quantized():
    r = run_multirank(_init_and_frozen, 2, timeout=240)[0]
    assert r["losses"][-1] < r["losses"][0]
    assert r["shard_bytes"] == 0  # the 16-bit shard holds no memory between gathers
    n = r["shard_numel"]  # 32768, a multiple of the block: int8 + a 4-byte scale per 256
    assert r["quantized_bytes"] == n + 4 * n // 256
    assert r["stored_quantized"]


def test_quantization_needs_stage_3():
    from zero_core.config import load_config

    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, key: True}}
        with pytest.raises(
            ValueError, match=f"zero_optimization.{key}: ZeRO\\+\\+ quantization needs stage 3"
        ):
            load_config(cfg)


def test_loco_is_refused():
    from zero_core.config import load_config

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_gradients": True,
            "zeropp_loco_param": {"err_beta": 0.8},
        },
    }
    with pytest.raises(
        ValueError,
        match="zeropp_loco_param: .* asks for LoCo error feedback .* which zero does not implement",
    ):
        load_config(cfg)
