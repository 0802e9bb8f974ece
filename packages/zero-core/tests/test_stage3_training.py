"""Stage 3 training features against single-process references, all in one 2-rank launch.

Activation checkpointing (recomputation re-gathers the released parameters), gradient
clipping, frozen parameters and parameter groups are compared with plain fp32 PyTorch
(1e-5 relative). bf16 and fp16 are compared with a reference written out by hand in this
file: fp32 master weights, a 16-bit model copy, per-rank 16-bit gradients averaged the way
the reduce-scatter does it (each divided by N, then summed in 16 bits), the optimizer on the
masters. The computation is then the same sequence of operations, so the tolerance is tight
(1e-3 relative on losses, 1e-4 on the fp32 masters) and only absorbs kernel-level summation
order. fp16 also checks dynamic loss scaling with an overflow on one rank: every rank skips
that step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from zero_core.testing import run_multirank

WORLD, STEPS, BATCH, IN, DIM = 2, 3, 4, 8, 16


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(DIM)
        self.fc1 = torch.nn.Linear(DIM, 4 * DIM)
        self.fc2 = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class Net(torch.nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, DIM)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.head = torch.nn.Linear(DIM, 4)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zero_core.activation_checkpointing import checkpoint

        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h) if self.ckpt else b(h)
        return self.head(h).float().pow(2).mean()


def _data() -> torch.Tensor:
    return torch.randn(STEPS, WORLD, BATCH, IN, generator=torch.Generator().manual_seed(11))


def _groups(model: torch.nn.Module) -> list[dict]:
    outer = list(model.inp.parameters()) + list(model.head.parameters())
    return [
        {"params": outer, "lr": 0.1},
        {"params": list(model.blocks.parameters()), "lr": 0.02, "weight_decay": 0.01},
    ]


def _frozen(model: torch.nn.Module) -> None:
    model.blocks[0].fc1.weight.requires_grad_(False)
    model.blocks[2].ln.bias.requires_grad_(False)


FP32_CASES = {
    "ckpt": {"ckpt": True},
    "plain": {},
    "clip": {"clip": 0.05},
    "frozen": {"frozen": True},
    "groups": {"groups": True},
}


def _fp32_reference(case: dict) -> tuple[list, dict]:
    torch.manual_seed(0)
    model = Net()
    if case.get("frozen"):
        _frozen(model)
    params = _groups(model) if case.get("groups") else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    data, losses = _data(), []
    for s in range(STEPS):
        row = []
        for r in range(WORLD):
            loss = model(data[s, r])
            (loss / WORLD).backward()
            row.append(loss.item())
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(row)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _lowp_reference(dtype: torch.dtype, scales: list[float], poison: tuple[int, int]) -> tuple[list, dict]:
    # The ranks compute with one thread (the harness sets it); a 16-bit matmul's rounding depends on
    # how the reduction is split across threads, so the reference must use one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _lowp_reference_one_thread(dtype, scales, poison)
    finally:
        torch.set_num_threads(threads)


def _lowp_reference_one_thread(
    dtype: torch.dtype, scales: list[float], poison: tuple[int, int]
) -> tuple[list, dict]:
    torch.manual_seed(0)
    model = Net()
    low = copy.deepcopy(model).to(dtype)
    # zero.Init with a 16-bit config creates 16-bit parameters: the masters start from those.
    masters = [torch.nn.Parameter(p.detach().float()) for p in low.parameters()]
    opt = torch.optim.Adam(masters, lr=1e-2)
    data, losses = _data(), []
    for s in range(STEPS):
        per_rank, row = [], []
        for r in range(WORLD):
            x = data[s, r].to(dtype)
            if (s, r) == poison:
                x = x * float("inf")
            low.zero_grad()
            loss = low(x)
            (loss.float() * scales[s]).backward()
            per_rank.append([p.grad.clone() for p in low.parameters()])
            row.append(loss.item())
        losses.append(row)
        avg = [sum(g[i] / WORLD for g in per_rank) for i in range(len(masters))]  # in 16 bits
        if not all(bool(torch.isfinite(g).all()) for g in avg):
            continue  # overflow: skipped on every rank
        for m, g in zip(masters, avg):
            m.grad = g.float() * (1.0 / scales[s])
        opt.step()
        with torch.no_grad():
            for p, m in zip(low.parameters(), masters):
                p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return losses, {n: m.detach().clone() for n, m in zip(names, masters)}


def _rank() -> dict:
    import zero_core
    from zero_core import comm
    from zero_core.utils import safe_get_full_fp32_param

    rank = comm.get_rank()
    data = _data()
    out: dict = {}
    comm.comms_logger.enable()
    for name, case in {**FP32_CASES, "bf16": {"dtype": "bf16"}, "fp16": {"dtype": "fp16"}}.items():
        cfg: dict = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_clipping": case.get("clip", 0.0),
            "zero_optimization": {
                "stage": 3,
                "param_persistence_threshold": 0,
                "prefetch_bucket_size": 3000,
                "reduce_bucket_size": 2000,
            },
        }
        if case.get("dtype") == "bf16":
            cfg["bf16"] = {"enabled": True}
        if case.get("dtype") == "fp16":
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        torch.manual_seed(0)
        with zero_core.Init(config_dict_or_path=cfg):
            model = Net(ckpt=case.get("ckpt", False))
        if case.get("frozen"):
            _frozen(model)
        if "dtype" in case:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        elif case.get("groups"):
            opt = torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        engine, *_ = zero_core.initialize(model=model, optimizer=opt, config=cfg)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case.get("dtype"), torch.float32)
        losses, scales = [], []
        comm.comms_logger.reset()
        for s in range(STEPS):
            x = data[s, rank].to(dtype)
            if case.get("dtype") == "fp16" and (s, rank) == (1, 0):
                x = x * float("inf")  # overflow on rank 0 only
            scales.append(engine.loss_scaler.loss_scale)
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[name] = {
            "losses": losses,
            "scales": scales,
            "skipped": engine.skipped_steps,
            # safe_get_* returns None for a frozen parameter (as DeepSpeed): gather those instead
            "state": {
                n: safe_get_full_fp32_param(p) if p.requires_grad else _gathered(zero_core, p)
                for n, p in model.named_parameters()
            },
            "ag_bytes": comm.comms_logger.bytes_for("all_gather_into_tensor"),
            "buckets": engine.strategy.reducer.launched,
        }
    return out


def _gathered(zero_core, p: torch.nn.Parameter) -> torch.Tensor:
    with zero_core.GatheredParameters([p]):
        return p.detach().float().clone()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_multirank(_rank, WORLD, timeout=120)


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b) + 1e-7


@pytest.mark.parametrize("case", sorted(FP32_CASES))
def test_fp32_feature_parity(results: list[dict], case: str) -> None:
    ref_losses, ref_state = _fp32_reference(FP32_CASES[case])
    for r in range(WORLD):
        got = results[r][case]
        for s in range(STEPS):
            assert _close(got["losses"][s], ref_losses[s][r], 1e-5), (case, r, s)
        for k, v in ref_state.items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"{case}: {k}")


def test_activation_checkpointing_regathers(results: list[dict]) -> None:
    # Recomputation runs every block's forward again in backward, gathering its parameters.
    assert results[0]["ckpt"]["ag_bytes"] > results[0]["plain"]["ag_bytes"]


def test_gradients_are_bucketed(results: list[dict]) -> None:
    n_params = len(results[0]["plain"]["state"])
    # reduce_bucket_size 2000 elements: several parameters per reduce-scatter.
    assert 0 < results[0]["plain"]["buckets"] < n_params * STEPS


def test_bf16_matches_hand_written_reference(results: list[dict]) -> None:
    ref_losses, ref_state = _lowp_reference(torch.bfloat16, [1.0] * STEPS, (-1, -1))
    for r in range(WORLD):
        got = results[r]["bf16"]
        for s in range(STEPS):
            assert _close(got["losses"][s], ref_losses[s][r], 1e-3), (
                r,
                s,
                got["losses"][s],
                ref_losses[s][r],
            )
        for k, v in ref_state.items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_fp16_loss_scaling_and_overflow_skip(results: list[dict]) -> None:
    scales = results[0]["fp16"]["scales"]
    assert scales[0] == 2.0**8 and scales[2] == 2.0**7, scales  # halved after the overflow
    ref_losses, ref_state = _lowp_reference(torch.float16, scales, (1, 0))
    for r in range(WORLD):
        got = results[r]["fp16"]
        assert got["skipped"] == 1 and got["scales"] == scales
        for s in range(STEPS):
            if (s, r) == (1, 0):
                continue  # the poisoned micro-batch
            assert _close(got["losses"][s], ref_losses[s][r], 1e-3), (
                r,
                s,
                got["losses"][s],
                ref_losses[s][r],
            )
        for k, v in ref_state.items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)
