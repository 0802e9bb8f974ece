"""Config keys through the pipeline engine: the ones it carries out change what it prints or
loads, the ones it does not are refused at construction (See [Note: config key truth])."""

from __future__ import annotations

import contextlib
import io

import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineModule

DIM, MB = 6, 2
BASE = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 2, "steps_per_print": 1}


def _module(sparse: bool = False) -> PipelineModule:
    first = LayerSpec(nn.Linear, DIM, DIM) if not sparse else LayerSpec(nn.Embedding, 10, DIM, sparse=True)
    specs = [first, LayerSpec(nn.Tanh), LayerSpec(nn.Linear, DIM, 3)]
    return PipelineModule(specs, num_stages=2, loss_fn=nn.functional.cross_entropy, seed_layers=True)


def _batches() -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(MB, DIM, generator=g), torch.randint(0, 3, (MB,), generator=g)) for _ in range(2)]


def _printed(extra: dict) -> str:
    from zero_core import initialize

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cfg = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, **extra}
        engine, *_ = initialize(model=_module(), config=cfg)
        engine.train_batch(iter(_batches()))
    return out.getvalue()


def _refused(extra: dict, sparse: bool = False) -> str:
    from zero_core import initialize

    cfg = {**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, **extra}
    try:
        initialize(model=_module(sparse), config=cfg)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _cases() -> dict:
    return {
        "plain": _printed({}),
        "dump": _printed({"dump_state": True}),
        "memory": _printed({"memory_breakdown": True, "timers": {"throughput": {"enabled": False}}}),
        "wall_clock": _refused({"wall_clock_breakdown": True}),
        "accum": _refused({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}),
        "sparse": _refused({}, sparse=True),
    }


def test_pipeline_prints_what_the_keys_ask_and_refuses_what_it_does_not_do() -> None:
    out = run_multirank(_cases, 2, timeout=240)[0]
    assert "samples/sec" in out["plain"] and "engine state (dump_state)" not in out["plain"]
    assert '"engine": "PipelineEngine"' in out["dump"] and '"zero_stage": 0' in out["dump"]
    assert "samples/sec" not in out["memory"] and "memory (this rank) parameters" in out["memory"]
    assert "wall_clock_breakdown: true is not implemented by the pipeline engine" in out["wall_clock"]
    assert "data_types.grad_accum_dtype" in out["accum"] and "not implemented with a pipeline" in out["accum"]
    assert "sparse=True embeddings" in out["sparse"]


def _masters(tmp: str, from_fp32: bool) -> list[torch.Tensor]:
    from zero_core import initialize

    cfg = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.05}}, "bf16": {"enabled": True}}
    engine, *_ = initialize(model=_module(), config=cfg)
    engine.train_batch(iter(_batches()))
    engine.save_checkpoint(tmp, tag="t")
    cfg["zero_optimization"] = {"load_from_fp32_weights": from_fp32}
    fresh, *_ = initialize(model=_module(), config=cfg)
    fresh.load_checkpoint(tmp, tag="t")
    return [m.detach().clone() for m in fresh.strategy.master.values()]


def test_pipeline_load_from_fp32_weights_false_rebuilds_the_masters(tmp_path) -> None:
    saved, rebuilt = run_multirank(
        lambda: (_masters(str(tmp_path / "a"), True), _masters(str(tmp_path / "b"), False)), 2
    )[0]
    assert all(torch.equal(r, s.bfloat16().float()) for r, s in zip(rebuilt, saved))
    assert any(not torch.equal(s, s.bfloat16().float()) for s in saved)
