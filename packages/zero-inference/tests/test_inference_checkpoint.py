"""Loading HF safetensors checkpoints into an empty model; ZeRO-Inference partitioning."""

from __future__ import annotations

import json

import inference_models as M
import pytest
import torch
import zero_inference as zi


@pytest.mark.parametrize("make", [M.gpt2, M.llama], ids=["gpt2", "llama"])
def test_hf_safetensors_dir_into_empty_model(make, tmp_path) -> None:
    make().save_pretrained(tmp_path)
    with zi.empty_model():
        empty = make(seed=9)
    assert all(p.is_meta for p in empty.parameters())
    engine = zi.init_inference(empty, dtype="fp32", checkpoint=str(tmp_path))
    x = M.ids()
    with torch.no_grad():
        want = make()(x).logits
    assert float((engine(x).logits - want).abs().max()) == 0.0


def test_json_load_policy(tmp_path) -> None:
    M.llama().save_pretrained(tmp_path)
    policy = {"type": "ds_model", "checkpoints": ["model.safetensors"], "version": 1.0}
    (tmp_path / "policy.json").write_text(json.dumps(policy))
    with zi.empty_model():
        empty = M.llama(seed=9)
    engine = zi.init_inference(empty, dtype="fp32", checkpoint="policy.json", base_dir=str(tmp_path))
    with torch.no_grad():
        assert torch.equal(engine(M.ids()).logits, M.llama()(M.ids()).logits)


def test_checkpoint_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a safetensors file nor a directory"):
        zi.init_inference(M.gpt2(), dtype="fp32", checkpoint=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="pickle checkpoints are not loaded"):
        zi.init_inference(M.gpt2(), dtype="fp32", checkpoint="model.bin")
    with zi.empty_model():
        empty = M.gpt2()
    with pytest.raises(ValueError, match="meta device; pass checkpoint="):
        zi.init_inference(empty, dtype="fp32")


def test_zero_inference_gathers_per_layer() -> None:
    x = M.ids()
    with torch.no_grad():
        want = M.llama()(x).logits
    engine = zi.init_inference(M.llama(), dtype="fp32", zero={"stage": 3, "offload_param": {"device": "cpu"}})
    layer_params = list(engine.module.model.layers.parameters())
    assert all(p.numel() == 0 for p in layer_params)  # released outside their layer's forward
    assert torch.equal(engine(x).logits, want)
    assert all(p.numel() == 0 for p in layer_params)
    assert torch.equal(
        engine.generate(x, max_new_tokens=3),
        M.llama().generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False, pad_token_id=0
        ),
    )


_MODELS = {"gpt2": M.gpt2, "llama": M.llama}


def _train_and_serve(ckpt_dir: str, arch: str, stage: int) -> dict[str, float]:
    """2 ranks: train a tiny model 2 steps with ZeRO stage ``stage``, save, then serve it at TP=2."""
    import zero_core
    from zero_inference.zero_checkpoint_source import ZeroCheckpointSource

    make = _MODELS[arch]
    model = make()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zero_core.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = M.ids()
    for _ in range(2):
        engine.backward(engine(x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(ckpt_dir)
    trained = make()
    trained.load_state_dict(engine.module.state_dict())
    with torch.no_grad():
        want = trained(x).logits
    read = {"elements": 0}
    original = ZeroCheckpointSource._read

    def counting(self, name, start=0, end=None):  # noqa: ANN001, ANN202
        t = original(self, name, start, end)
        read["elements"] += t.numel()
        return t

    ZeroCheckpointSource._read = counting
    try:
        with zi.empty_model():
            empty = make(seed=9)
        served = zi.init_inference(empty, tensor_parallel={"tp_size": 2}, dtype="fp32", checkpoint=ckpt_dir)
    finally:
        ZeroCheckpointSource._read = original
    with torch.no_grad():
        got = served(x).logits
    full = sum(p.numel() for p in trained.parameters())
    return {
        "tp2": float((got - want).abs().max() / want.abs().max()),
        "changed": float((want - make()(x).logits).abs().max()),
        "read_fraction": read["elements"] / full,
        "want": want.tolist(),
    }


@pytest.mark.parametrize("arch, stage", [("gpt2", 2), ("llama", 0)])
def test_zero_training_checkpoint_served_at_tp2_and_single(tmp_path, arch: str, stage: int) -> None:
    from zero_core.testing import run_multirank

    results = run_multirank(_train_and_serve, 2, args=(str(tmp_path), arch, stage), timeout=240)
    for res in results:
        res = {k: v for k, v in res.items() if k != "want"}
        assert res["tp2"] < 1e-5 and res["changed"] > 0, res  # trained weights, served exactly
        assert res["read_fraction"] < 0.75, res  # each TP rank read about half the model
    # Single process: the latest tag of the save directory, and one tag directory directly.
    tag = (tmp_path / "latest").read_text().strip()
    outs = []
    for ckpt in (str(tmp_path), str(tmp_path / tag)):
        with zi.empty_model():
            empty = _MODELS[arch](seed=9)
        outs.append(zi.init_inference(empty, dtype="fp32", checkpoint=ckpt)(M.ids()).logits)
    want = torch.tensor(results[0]["want"])
    assert torch.equal(outs[0], outs[1])
    assert float((outs[0] - want).abs().max() / want.abs().max()) < 1e-5


def _zero_inference_worker(nvme_dir: str) -> dict[str, float | bool | int]:
    x = M.ids()
    with torch.no_grad():
        want = M.llama()(x).logits
    out: dict[str, float | bool | int] = {}
    for label, offload in [("none", None), ("nvme", {"device": "nvme", "nvme_path": nvme_dir})]:
        zero = {"stage": 3} if offload is None else {"stage": 3, "offload_param": offload}
        engine = zi.init_inference(M.llama(), dtype="fp32", zero=zero)
        out[f"{label}_logits"] = float((engine(x).logits - want).abs().max())
        out[f"{label}_numel"] = engine.zero_partitioner.partition_numel()
        out[f"{label}_released"] = all(p.numel() == 0 for p in engine.module.model.layers.parameters())
        engine.close()
    out["full_numel"] = sum(p.numel() for p in M.llama().model.layers.parameters())
    return out


def test_zero_inference_two_ranks_exact(tmp_path) -> None:
    from zero_core.testing import run_multirank

    for res in run_multirank(_zero_inference_worker, 2, args=(str(tmp_path),), timeout=180):
        for label in ("none", "nvme"):
            assert res[f"{label}_logits"] == 0.0 and res[f"{label}_released"], res
            assert res[f"{label}_numel"] <= res["full_numel"] // 2 + 64, res  # half of every layer


def test_zero_inference_nvme_offload_single_process(tmp_path) -> None:
    x = M.ids()
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    engine = zi.init_inference(M.llama(), dtype="fp32", zero=zero)
    files = list(tmp_path.glob("*/rank0/*.swp"))  # nvme_path/<job>/rank0: See [Note: swap file lifecycle]
    assert len(files) == len(list(M.llama().model.layers.parameters()))  # one file per partition
    with torch.no_grad():
        want = M.llama()(x).logits
    assert torch.equal(engine(x).logits, want)
    assert torch.equal(engine(x).logits, want)  # second pass uses the prefetched first layer
    assert torch.equal(
        engine.generate(x, max_new_tokens=3),
        M.llama().generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False, pad_token_id=0
        ),
    )


def _forked_child_drops_backend(path: str) -> bool:
    import gc

    gc.collect()  # the parent's live backend (inherited) is destroyed here: must not hang
    return True


def test_nvme_backend_survives_fork(tmp_path) -> None:
    from zero_core.testing import run_multirank
    from zero_offload.backends import NvmeOffloadBackend

    backend = NvmeOffloadBackend(tmp_path)
    backend.swap_out("a", torch.ones(4))
    del backend  # a reference cycle or a late GC would leave it alive at the fork: same effect
    live = NvmeOffloadBackend(tmp_path / "live")
    assert all(run_multirank(_forked_child_drops_backend, 2, args=(str(tmp_path),), timeout=60))
    live.close()


def test_nvme_backend_follows_the_offload_protocol(tmp_path) -> None:
    from zero_core.protocols import OffloadBackend
    from zero_offload.backends import NvmeOffloadBackend

    backend = NvmeOffloadBackend(tmp_path)
    assert isinstance(backend, OffloadBackend)
    a = torch.randn(5, 7)
    backend.swap_out("a", a, async_op=True)
    backend.wait()
    out = torch.empty(7, 5).t()  # non-contiguous: read through a staging buffer
    with pytest.raises(ValueError, match="holds \\(5, 7\\)"):
        backend.swap_in("a", torch.empty(3))
    backend.swap_in("a", out, async_op=False)
    assert torch.equal(out, a) and not out.is_contiguous()
    got = torch.empty(5, 7)
    backend.swap_in("a", got, async_op=True)
    backend.wait()
    assert torch.equal(got, a)
    backend.swap_out("a", a * 2)  # replace in place
    backend.swap_in("a", got)
    assert torch.equal(got, a * 2)
    assert backend.contains("a")
    backend.remove("a")
    assert not backend.contains("a")
    with pytest.raises(KeyError, match="nothing is stored under key 'a'"):
        backend.swap_in("a", got)
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.swap_out("b", a)
