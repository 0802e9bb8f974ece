"""ZeRO-Infinity streams instead of materialising (see [Note: ZeRO-Infinity streaming]).

Stage 3 with parameters and optimizer on NVMe against plain stage 3 on the same model and data
(fp32, 1, 2 and 4 ranks): after backward every gradient shard was dropped from memory once staged
to its swap file, yet ``safe_get_full_grad`` / ``safe_get_local_grad`` read the same values
back; a gradient replaced with ``safe_set_full_grad`` after backward is the one the step uses;
the updated weights match; no whole-partition host buffer exists (masters, gradients, updated
weights); the checkpoint fragments of offloaded values are deferred (a ``meta`` placeholder,
read when written) with the same values; the swap counters move. fp16: an inf gradient set
after backward skips the step as it does without offload. Plus the disk-space check and the
host heap bound.
"""

from __future__ import annotations

import os

import pytest
import torch
from zero_core.testing import run_multirank
from zero_core.testing.models import TinyLM, token_batch

VOCAB, SEQ, MICRO = 32, 8, 2


def _engine(offload: bool, nvme: str, precision: str = "fp32"):
    import zero_core

    torch.manual_seed(0)
    model = TinyLM(VOCAB, 16, 23)
    zc = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1000}
    if offload:
        zc["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pipeline_read": True}
        zc["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_size": 2048, "max_in_cpu": 0}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.5, "zero_optimization": zc}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    engine, *_ = zero_core.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg
    )
    return engine, model


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from zero_core.zero.stage3 import GatheredParameters

    out = {}
    for n, p in model.named_parameters():
        with GatheredParameters([p]):
            out[n] = p.detach().clone()
    return out


def _run(offload: bool, nvme: str) -> dict:
    from zero_core import comm
    from zero_core.zero.debug_access import safe_get_full_grad, safe_get_local_grad, safe_set_full_grad
    from zero_core.zero.stage3.param_records import partition_state

    engine, model = _engine(offload, nvme)
    x, y = token_batch(7, comm.get_world_size() * MICRO, SEQ, VOCAB)
    r = comm.get_rank()
    x, y = x[r * MICRO : (r + 1) * MICRO], y[r * MICRO : (r + 1) * MICRO]
    io0 = engine.strategy.swap_io_bytes()
    engine.backward(engine(x, y))
    params = dict(model.named_parameters())
    out = {
        "in_memory_grads": sum(partition_state(p).grad_shard is not None for p in params.values()),
        "full_grads": {n: safe_get_full_grad(p).clone() for n, p in params.items()},
        "local_grads": {n: safe_get_local_grad(p).clone() for n, p in params.items()},
    }
    first = next(iter(params))
    safe_set_full_grad(params[first], -out["full_grads"][first])  # flips its Adam step
    fragments = engine.strategy.checkpoint_fragments()
    out["fragments"] = {(f.name, f.kind, f.start): f.values().clone() for f in fragments}
    out["deferred_kinds"] = sorted({f.kind for f in fragments if f.produce is not None})
    out["deferred_on_meta"] = all(f.tensor.device.type == "meta" for f in fragments if f.produce is not None)
    engine.step()
    out["weights"] = _gathered(model)
    out["breakdown"] = engine.memory_breakdown()
    io1 = engine.strategy.swap_io_bytes()
    out["io"] = (io1["read"] - io0["read"], io1["written"] - io0["written"])
    out["streams"] = engine.strategy.offload.streams_gradients()
    engine.destroy()
    return out


def _both(nvme: str) -> tuple[dict, dict]:
    return _run(True, nvme), _run(False, nvme)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_streamed_gradients_and_masters_match_plain_stage3(world: int, tmp_path) -> None:
    for rank, (off, ref) in enumerate(run_multirank(_both, world, args=(str(tmp_path),), timeout=180)):
        assert off["streams"] and not ref["streams"]
        assert off["in_memory_grads"] == 0 and ref["in_memory_grads"] > 0, rank  # dropped once staged
        for n, g in ref["full_grads"].items():
            torch.testing.assert_close(
                off["full_grads"][n], g.float(), rtol=0, atol=0, msg=f"{n} rank {rank}"
            )
            torch.testing.assert_close(off["local_grads"][n], ref["local_grads"][n], rtol=0, atol=0)
        # the step used the gradient set after backward, clipped on the streamed gradients' norm
        for n, w in ref["weights"].items():
            torch.testing.assert_close(off["weights"][n], w, rtol=1e-5, atol=1e-6, msg=f"{n} rank {rank}")
        bd = off["breakdown"]
        assert bd["host_master_weights"] == 0 and bd["host_gradients"] == 0, bd
        assert bd["host_low_precision_params"] == 0 and bd["host_optimizer_states"] <= 4 * 16, bd
        read, written = off["io"]
        assert read > 0 and written > 0, off["io"]
        # masters, optimizer states and offloaded weights are read only when a checkpoint writes them
        assert set(off["deferred_kinds"]) >= {"fp32", "optim.exp_avg", "optim.exp_avg_sq", "param"}
        assert off["deferred_on_meta"]
        for key, values in off["fragments"].items():
            name, kind, start = key
            if kind in ("fp32", "param") and (name, "param", start) not in ref["fragments"]:
                torch.testing.assert_close(values.float(), ref["fragments"][(name, "fp32", start)].float())
            elif key in ref["fragments"]:
                torch.testing.assert_close(values, ref["fragments"][key], msg=str(key))


def _fp16_overflow(nvme: str) -> list[tuple[int, int]]:
    from zero_core.zero.debug_access import safe_get_full_grad, safe_set_full_grad

    out = []
    for offload in (True, False):
        engine, model = _engine(offload, nvme, "fp16")
        x, y = token_batch(3, MICRO, SEQ, VOCAB)
        engine.backward(engine(x, y))
        p = next(iter(model.parameters()))
        g = safe_get_full_grad(p)
        g.view(-1)[0] = float("inf")
        safe_set_full_grad(p, g)
        engine.step()
        out.append((engine.global_steps, engine.skipped_steps))
        engine.destroy()
    return out


def test_streamed_gradient_overflow_skips_the_step(tmp_path) -> None:
    (res,) = run_multirank(_fp16_overflow, 1, args=(str(tmp_path),), timeout=120)
    assert res[0] == res[1] and res[0][1] == 1, res  # skipped with and without offload


def test_check_free_space_names_the_folder_and_bytes(tmp_path) -> None:
    from zero_offload import SwapFileError, check_free_space

    check_free_space(tmp_path / "not" / "yet", 1, "test")  # an existing parent's file system answers
    with pytest.raises(SwapFileError) as err:
        check_free_space(tmp_path, 10**18, "my run")
    assert (
        str(tmp_path) in str(err.value)
        and "1000000000.00 GB" in str(err.value)
        and "my run" in str(err.value)
    )
    with pytest.raises(ValueError, match="nbytes"):
        check_free_space(tmp_path, -1, "x")


def _heap(env: dict) -> tuple:
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    os.environ.pop("ZERO_MMAP_THRESHOLD", None)
    os.environ.update(env)
    from zero_offload import host_heap

    try:
        return host_heap.mmap_threshold(), host_heap.bound_host_heap()
    except ValueError as e:
        return ("error", str(e))


def test_host_heap_threshold_setting(tmp_path) -> None:
    glibc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    cases = [
        ({}, 128 << 10),
        ({"ZERO_MMAP_THRESHOLD": "0"}, 0),
        ({"ZERO_MMAP_THRESHOLD": "1048576"}, 1 << 20),
    ]
    for env, want in cases:
        (got,) = run_multirank(_heap, 1, args=(env,))
        assert got[0] == want, (env, got)
        assert got[1] == (None if want == 0 or not glibc else want), (env, got)
    (got,) = run_multirank(_heap, 1, args=({"ZERO_MMAP_THRESHOLD": "lots"},))
    assert got[0] == "error" and "ZERO_MMAP_THRESHOLD" in got[1], got
    (got,) = run_multirank(_heap, 1, args=({"MALLOC_MMAP_THRESHOLD_": "65536"},))
    assert got == (128 << 10, None), got  # glibc's own variable wins: left alone


@pytest.mark.parametrize(
    ("stage", "device", "bucket", "warns"),
    [(3, "nvme", None, True), (3, "nvme", 4096, False), (3, "cpu", None, False), (2, "nvme", None, False)],
)
def test_reduce_bucket_larger_than_the_streamed_tiles_is_reported(
    stage, device, bucket, warns, tmp_path
) -> None:
    """Stage 3 with NVMe optimizer offload and DeepSpeed's default reduce_bucket_size (5e8) under a
    small sub_group_size: backward may hold far more gradients than the optimizer's buffers. The
    config runs (as in DeepSpeed); a UserWarning names the key, its bytes and the remedy."""
    import warnings

    from zero_core.config.loader import load_config
    from zero_offload.optimizer_offload import build_optimizer_offload

    zc: dict = {"stage": stage, "sub_group_size": 1024}
    zc["offload_optimizer"] = (
        {"device": device, "nvme_path": str(tmp_path)} if device == "nvme" else {"device": device}
    )
    if bucket is not None:
        zc["reduce_bucket_size"] = bucket
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zc}, world_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offload = build_optimizer_offload(cfg.zero_optimization, cfg.aio, rank=0)
    assert offload is not None
    offload.close()
    mine = [w for w in caught if "reduce_bucket_size" in str(w.message)]
    if warns:
        assert len(mine) == 1, [str(w.message) for w in caught]
        text = str(mine[0].message)
        assert "500000000" in text and "1.9 GiB in float32" in text and "sub_group_size (1024)" in text, text
    else:
        assert not mine, [str(w.message) for w in mine]
