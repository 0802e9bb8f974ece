"""Load a Hugging Face GPT-2 checkpoint larger than memory straight into NVMe partitions.

    python examples/write_random_gpt2.py /work/gpt2_2b --n_embd 2560 --n_layer 24 --n_head 20
    zero run --nproc 2 examples/from_pretrained_infinity.py /work/gpt2_2b --nvme_path /work/nvme_swap \\
        --max_rss_gib 12 --forward

``zero.integrations.from_pretrained`` builds ``GPT2LMHeadModel`` inside ``zero.Init`` with the
config's ``offload_param: nvme`` (``examples/configs/infinity_nvme_gpt2.json``: its
``buffer_size`` holds a shard of GPT-2's 50257 x n_embd embedding), so each submodule's
shards go to the swap folder as it is built, then reads exactly this rank's range of every
tensor from the safetensors shards (one ``pread`` each) into its partition on NVMe
([Note: from_pretrained into partitions]). Checked and reported per rank: peak RSS of each
phase (``rss_phases.py``), the tensor bytes it read from the files (``from_pretrained``'s
``stats``) against the checkpoint's size, and a few tensors gathered and compared with what ``write_random_gpt2.py``
wrote. ``--forward`` then runs one forward pass through an engine without an optimizer (the
loss of a short random sequence). ``--max_rss_gib`` fails the run (exit code 3) when a phase's
summed per-rank peak RSS exceeds it; ``--results`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zero  # noqa: E402
from rss_phases import PhaseMeter  # noqa: E402
from write_random_gpt2 import tensor_values  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30


def check_swap_space(nvme_path: str, hf_config: object, config: dict) -> None:
    """Fail before loading, naming the folder and the bytes, unless the parameter swap files of
    all ranks (the model in the config's training dtype, 2 % for alignment) fit in ``nvme_path``."""
    from write_random_gpt2 import gpt2_layout
    from zero.offload import check_free_space

    itemsize = 2 if any(config.get(k, {}).get("enabled") for k in ("bf16", "fp16")) else 4
    need = itemsize * sum(math.prod(s) for _, s in gpt2_layout(hf_config))
    check_free_space(
        nvme_path, int(need * 1.02) + (64 << 20), "from_pretrained_infinity: parameter swap files"
    )


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def verify(model: torch.nn.Module, n_layer: int) -> list[str]:
    """Gather a few tensors and compare them with the writer's values; returns the names checked."""
    names = [
        "transformer.wpe.weight",
        "transformer.h.0.attn.c_attn.weight",
        f"transformer.h.{n_layer - 1}.mlp.c_proj.bias",
        "transformer.ln_f.weight",
    ]
    params = dict(model.named_parameters())
    for name in names:
        p = params[name]
        with zero.GatheredParameters([p]):
            got = p.detach().clone()
        want = tensor_values(name, tuple(got.shape), got.dtype)
        if not torch.equal(got, want):
            raise AssertionError(f"from_pretrained_infinity: {name} differs from the values written")
    return names


def forward_loss(model: torch.nn.Module, config: dict, vocab: int) -> float:
    """One forward pass (no optimizer: an evaluation engine) of a random 32-token sequence."""
    cfg = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
    cfg["zero_optimization"] = {k: v for k, v in cfg["zero_optimization"].items() if k != "offload_optimizer"}
    engine, *_ = zero.initialize(model=model, config=cfg)
    try:
        ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            return float(engine(input_ids=ids, labels=ids).loss)
    finally:
        engine.destroy()


def main(argv: list[str] | None = None) -> int:
    import transformers
    from train_gpt_infinity import gathered

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a save_pretrained directory (see write_random_gpt2.py)")
    p.add_argument("--nvme_path", required=True)
    p.add_argument("--forward", action="store_true", help="run one forward pass after loading")
    p.add_argument("--max_rss_gib", type=float, default=None)
    p.add_argument("--results", default=None)
    zero.add_config_arguments(p)
    args = p.parse_args(argv)
    with open(args.zero_config or os.path.join(_HERE, "configs", "infinity_nvme_gpt2.json")) as f:
        config = json.load(f)
    for key in ("offload_param", "offload_optimizer"):
        config["zero_optimization"].setdefault(key, {})["nvme_path"] = args.nvme_path
    hf_config = transformers.AutoConfig.from_pretrained(args.model_dir)
    check_swap_space(args.nvme_path, hf_config, config)
    zero.init_distributed()
    # the modules and kernels every run loads, before the memory baseline (as train_gpt_infinity.py)
    tiny = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    forward_loss(transformers.GPT2LMHeadModel(tiny), config, 64)
    meter = PhaseMeter()
    stats: dict[str, int] = {}
    with meter.phase("from_pretrained"):
        model = zero.integrations.from_pretrained(
            transformers.GPT2LMHeadModel, args.model_dir, config, stats=stats, attn_implementation="eager"
        )
    read = stats["bytes_read"]
    with meter.phase("verify"):
        checked = verify(model, hf_config.n_layer)
    loss = None
    if args.forward:
        with meter.phase("forward"):
            loss = forward_loss(model, config, hf_config.vocab_size)
    meter.close()
    rows = gathered([read, *(v for ph in meter.phases for v in (ph.seconds, ph.peak))])
    total = checkpoint_bytes(args.model_dir)
    out = {
        "parameters": sum(getattr(q, "zero_numel", q.numel()) for q in model.parameters()),
        "checkpoint_bytes": total,
        "read_bytes_per_rank": [int(v) for v in rows[:, 0].tolist()],
        "checked": checked,
        "loss": loss,
        "max_rss_gib": args.max_rss_gib,
        "phases": [
            {
                "phase": ph.name,
                "seconds": rows[:, 1 + 2 * k].max().item(),
                "peak_rss_per_rank": [int(v) for v in rows[:, 2 + 2 * k].tolist()],
                "peak_growth_per_rank": [int(v - meter.base) for v in rows[:, 2 + 2 * k].tolist()],
            }
            for k, ph in enumerate(meter.phases)
        ],
    }
    over = [
        r["phase"]
        for r in out["phases"]
        if args.max_rss_gib is not None and sum(r["peak_rss_per_rank"]) > args.max_rss_gib * GIB
    ]
    out["over_ceiling"] = over
    if zero.comm.get_rank() == 0:
        print(
            f"[from_pretrained] {out['parameters'] / 1e9:.3f}B parameters, {total / 1e9:.2f} GB of safetensors"
        )
        print(f"[from_pretrained] read per rank: {[f'{v / 1e9:.2f} GB' for v in out['read_bytes_per_rank']]}")
        for r in out["phases"]:
            per = " + ".join(f"{v / GIB:.2f}" for v in r["peak_rss_per_rank"])
            print(f"[from_pretrained] {r['phase']:<16} {r['seconds']:8.1f} s  peak RSS {per} GiB", flush=True)
        if loss is not None:
            print(f"[from_pretrained] forward loss {loss:.4f}", flush=True)
        if args.results:
            with open(args.results, "w") as f:
                json.dump(out, f, indent=1)
    return 3 if over else 0


if __name__ == "__main__":
    sys.exit(main())
