"""fp32 consolidation: equals the gathered master weights exactly; shards, index, tool, bin output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not ~4 s in every forked rank)
import torch.nn as nn
import zero_core.engine  # noqa: F401
from safetensors import safe_open
from safetensors.torch import load_file
from zero_core.testing import run_multirank


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(7, 33)
        self.l2 = nn.Linear(33, 9)
        self.frozen = nn.Linear(9, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(torch.relu(self.l2(torch.relu(self.l1(x))))).pow(2).mean()


def _train_and_gather(tmp: str) -> dict:
    import torch.distributed as dist
    import zero_core

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 64},
    }
    engine, *_ = zero_core.initialize(model=Net(), config=cfg)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 7).bfloat16()))
        engine.step()
    engine.save_checkpoint(tmp)
    masters = {
        n: engine.strategy.state_access.full_fp32_param(p).clone()
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }
    frozen = {
        n: p.detach().float().clone() for n, p in engine.module.named_parameters() if not p.requires_grad
    }
    return {**masters, **frozen} if dist.get_rank() == 0 else {}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, dict]:
    """One 2-rank bf16 stage-2 checkpoint and its gathered masters, shared by this file's tests."""
    ckpt = str(tmp_path_factory.mktemp("z2f") / "ckpt")
    return ckpt, run_multirank(_train_and_gather, 2, args=(ckpt,))[0]


def test_conversion_equals_gathered_masters(trained, tmp_path):
    from zero_core.checkpoint import zero_to_fp32 as z

    ckpt, expected = trained
    got = z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
    # the bf16 weights were rounded: the masters really are the fp32 values, not the upcast weights
    assert not torch.equal(got["l1.weight"], got["l1.weight"].bfloat16().float())

    no_frozen = z.get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    assert set(no_frozen) == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}

    # sharded safetensors with a Hugging Face index
    out = tmp_path / "out" / "model.safetensors"
    files = z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size=1000, progress=False)
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    merged = {}
    for s in shards:
        merged.update(load_file(str(tmp_path / "out" / s)))
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in merged.values())
    assert all(torch.equal(merged[k], v) for k, v in expected.items()) and len(files) == len(shards) + 1

    # the tool, from the copy inside the checkpoint, into a single file
    single = tmp_path / "single.safetensors"
    assert z.main([ckpt, str(single), "-q"]) == 0
    assert os.path.isfile(os.path.join(ckpt, "global_step3", "zero_to_fp32.py"))
    assert all(torch.equal(load_file(str(single))[k], v) for k, v in expected.items())
    # torch .bin only on request
    binf = tmp_path / "m.bin"
    z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, binf, safe_serialization=False, progress=False)
    assert torch.equal(torch.load(binf, weights_only=True)["l2.bias"], expected["l2.bias"])

    model = z.load_state_dict_from_zero_checkpoint(Net(), ckpt)
    assert torch.equal(model.l1.weight.detach(), expected["l1.weight"])
    assert z.main([ckpt, str(single), "--max-shard-size", "lots"]) == 1


# Run the copy inside the checkpoint as a user would on a machine without zero_core: -I drops
# PYTHONPATH and user site, and a None entry in sys.modules makes any `import zero_core` fail.
_STANDALONE = (
    "import runpy, sys\n"
    "sys.modules['zero_core'] = None\n"
    "try:\n    import zero_core\n    sys.exit('the zero_core block failed')\nexcept ImportError:\n    pass\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_copied_script_runs_without_zero_core(trained, tmp_path):
    ckpt, expected = trained
    script = os.path.join(ckpt, "global_step3", "zero_to_fp32.py")
    out = tmp_path / "o" / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-I", "-c", _STANDALONE, script, ckpt, str(out), "--max-shard-size", "1500", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    index = json.load(open(tmp_path / "o" / "model.safetensors.index.json"))
    merged = {}
    for s in sorted(set(index["weight_map"].values())):
        merged.update(load_file(str(tmp_path / "o" / s)))
    assert set(merged) == set(expected)
    assert all(torch.equal(merged[k], v) for k, v in expected.items())


def test_inspect_and_clone_helpers(trained):
    import collections

    from zero_core.checkpoint.inspect import describe
    from zero_core.checkpoint.utils import clone_tensors_for_torch_save

    ckpt, _ = trained
    text = describe(ckpt)
    assert "world_size 2 | zero stage 2" in text and "rank_00001.safetensors" in text and "OK" in text
    assert "parameters 590 in 6 tensors" in text

    base = torch.arange(10.0)
    item = collections.OrderedDict(a=base[2:4], b=[base[:1], (base[5:6], 3)], c="x")
    out = clone_tensors_for_torch_save(item)
    assert type(out) is collections.OrderedDict and out["c"] == "x" and out["b"][1][1] == 3
    assert torch.equal(out["a"], base[2:4]) and out["a"].untyped_storage().nbytes() == 8
    assert out["a"].data_ptr() != base[2:4].data_ptr()


def test_script_next_to_latest_runs_like_deepspeeds(trained, tmp_path):
    # DeepSpeed users run `python zero_to_fp32.py . pytorch_model.bin` from the save directory.
    ckpt, expected = trained
    assert os.path.isfile(os.path.join(ckpt, "zero_to_fp32.py"))
    out = tmp_path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-I", "-c", _STANDALONE, "zero_to_fp32.py", ".", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ckpt,
    )
    assert done.returncode == 0, done.stderr
    merged = load_file(str(out))
    assert set(merged) == set(expected)
    assert all(torch.equal(merged[k], v) for k, v in expected.items())


class Tied(nn.Module):
    """An embedding tied to the output projection, as GPT-2's ``lm_head.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            self.head(torch.tanh(self.mid(self.emb(ids)))).flatten(0, 1), ids.flatten()
        )


def _train_tied(tmp: str) -> dict:
    import torch.distributed as dist
    import zero_core
    from zero_core.zero.debug_access import safe_get_full_fp32_param

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zero_core.initialize(model=Tied(), config=cfg)
    for step in range(2):
        engine.backward(engine(torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(step))))
        engine.step()
    engine.save_checkpoint(tmp)
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    return masters if dist.get_rank() == 0 else {}


def test_tied_weights_load_strictly(tmp_path):
    """The second name of a tied weight is in the state dict (and .bin), so a fresh model loads it strictly."""
    from zero_core.checkpoint import zero_to_fp32 as z

    ckpt = str(tmp_path / "ckpt")
    masters = run_multirank(_train_tied, 2, args=(ckpt,))[0]
    sd = z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert set(sd) == set(Tied().state_dict()) and sd["head.weight"] is sd["emb.weight"]
    assert all(torch.equal(sd[k], v) for k, v in masters.items())
    model = Tied()
    model.load_state_dict(sd, strict=True)
    assert model.head.weight is model.emb.weight and torch.equal(model.head.weight, masters["emb.weight"])
    # .bin, sharded: the alias sits in the owner's shard; safetensors leaves it out (from_pretrained re-ties)
    z.convert_zero_checkpoint_to_fp32_state_dict(
        ckpt, tmp_path / "b" / "m.bin", safe_serialization=False, max_shard_size=300, progress=False
    )
    index = json.load(open(tmp_path / "b" / "m.bin.index.json"))
    assert index["weight_map"]["head.weight"] == index["weight_map"]["emb.weight"]
    merged = {}
    for f in sorted(set(index["weight_map"].values())):
        merged.update(torch.load(tmp_path / "b" / f, weights_only=True))
    Tied().load_state_dict(merged, strict=True)
    assert index["metadata"]["total_size"] == sum(
        v.numel() * 4 for k, v in merged.items() if k != "head.weight"
    )
    # safetensors: the alias is its own copy (safetensors cannot share storage), recorded as tied in
    # the metadata, so the plain strict load the README shows works and keeps the tie.
    z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "m.safetensors", progress=False)
    flat = load_file(str(tmp_path / "m.safetensors"))
    assert set(flat) == set(sd) and torch.equal(flat["head.weight"], masters["emb.weight"])
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["tied_parameters"]) == [["head.weight", "emb.weight"]]
    model = Tied()
    model.load_state_dict(load_file(str(tmp_path / "m.safetensors")))
    assert model.head.weight is model.emb.weight and torch.equal(model.head.weight, masters["emb.weight"])
    # sharded safetensors: every name in the index, each shard a plain safetensors file
    z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "s" / "m.safetensors", max_shard_size=300)
    index = json.load(open(tmp_path / "s" / "m.safetensors.index.json"))
    assert set(index["weight_map"]) == set(sd)
    merged = {}
    for f in sorted(set(index["weight_map"].values())):
        merged.update(load_file(str(tmp_path / "s" / f)))
    Tied().load_state_dict(merged)


def test_output_directory_suffixes_and_deepspeed_flags(trained, tmp_path):
    """A directory output (DeepSpeed's usage) got a raw IsADirectoryError; safetensors bytes went into a
    file named .bin; DeepSpeed's underscore flags were refused."""
    from zero_core.checkpoint import zero_to_fp32 as z

    ckpt, expected = trained
    out = tmp_path / "hf"
    out.mkdir()
    assert z.main([ckpt, str(out), "-q"]) == 0
    assert all(torch.equal(load_file(str(out / "model.safetensors"))[k], v) for k, v in expected.items())
    assert z.main([ckpt, str(tmp_path / "new") + os.sep, "--bin", "--max_shard_size", "1000", "-q"]) == 0
    index = json.load(open(tmp_path / "new" / "pytorch_model.bin.index.json"))
    assert set(index["weight_map"].values()) == {
        f"pytorch_model-{i:05d}-of-{len(set(index['weight_map'].values())):05d}.bin"
        for i in range(1, len(set(index["weight_map"].values())) + 1)
    }
    with pytest.raises(ValueError, match=r"names a torch pickle file but the format is safetensors"):
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "pytorch_model.bin", progress=False)
    with pytest.raises(ValueError, match=r"names a safetensors file but safe_serialization=False"):
        z.convert_zero_checkpoint_to_fp32_state_dict(
            ckpt, tmp_path / "m.safetensors", safe_serialization=False, progress=False
        )
    assert z.main([ckpt, str(tmp_path / "pytorch_model.bin"), "-q"]) == 1
    assert not any(p.name.endswith(".bin") or ".tmp." in p.name for p in tmp_path.iterdir())
    single = tmp_path / "s.safetensors"
    assert z.main([ckpt, str(single), "--safe_serialization", "--exclude_frozen_parameters", "-q"]) == 0
    assert set(load_file(str(single))) == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}


def test_inspect_a_tag_directory_and_an_empty_one(trained, tmp_path):
    """A tag directory (as zero_to_fp32 takes) was reported as holding no tags, with exit status 0."""
    from zero_core.checkpoint.inspect import describe, main

    ckpt, _ = trained
    text = describe(os.path.join(ckpt, "global_step3"))
    assert "tags: ['global_step3']" in text and "rank_00001.safetensors" in text and "OK" in text
    assert main([str(tmp_path)]) == 1


def test_deepspeed_016_signature_output_dir_and_old_file_form(trained, tmp_path):
    """DeepSpeed >= 0.16: (checkpoint_dir, output_dir, max_shard_size, safe_serialization, tag,
    exclude_frozen_parameters), output_dir created if missing; the old (dir, output_file, tag) form
    still works by the documented rule (a weights suffix names a file; a non-size third argument
    is the tag)."""
    from zero_core.checkpoint import zero_to_fp32 as z

    ckpt, expected = trained
    tag = open(os.path.join(ckpt, "latest")).read().strip()
    out = tmp_path / "not_yet"  # no separator, not existing: a directory all the same
    files = z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, "1000", True, tag, True, progress=False)
    index = json.load(open(out / "model.safetensors.index.json"))
    assert len(files) == len(set(index["weight_map"].values())) + 1
    assert set(index["weight_map"]) == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}  # frozen left out
    merged = {}
    for name in set(index["weight_map"].values()):
        merged.update(load_file(str(out / name)))
    assert all(torch.equal(merged[k], expected[k]) for k in merged)
    # DeepSpeed < 0.16: (checkpoint_dir, output_file, tag)
    old = tmp_path / "old" / "weights.safetensors"
    assert z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, old, tag, progress=False) == [str(old)]
    assert all(torch.equal(load_file(str(old))[k], v) for k, v in expected.items())
    with pytest.raises(Exception, match="no_such_tag"):
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "x", "no_such_tag", progress=False)
