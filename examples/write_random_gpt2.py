"""Write a Hugging Face GPT-2 checkpoint with random weights, of any size, one tensor in memory at a time.

    python examples/write_random_gpt2.py /work/gpt2_2b --n_embd 2560 --n_layer 24 --n_head 20

writes ``config.json`` and ``model-0000k-of-0000N.safetensors`` shards with
``model.safetensors.index.json``: the layout ``save_pretrained`` writes, which transformers'
``from_pretrained`` and ``zero.integrations.from_pretrained`` load. The tensors' names and shapes
come from ``GPT2LMHeadModel`` built on the ``meta`` device (no memory); each tensor is generated
only when the writer reaches it (``zero_core.checkpoint.tensor_file``'s streaming writer) and
dropped once written, so the peak memory is the largest tensor, whatever the model's size.
Values are deterministic per tensor name (:func:`tensor_values`): layer-norm weights 1, biases
0, every other weight ``N(0, 0.02)``; a loader can regenerate any tensor to check what it read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import zlib

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def tensor_values(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The value written for tensor ``name`` (deterministic: seeded by the name)."""
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    if ".ln_" in name and name.endswith(".weight"):
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, dtype=dtype).mul_(0.02)


def gpt2_layout(config: object) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor ``save_pretrained`` writes for ``GPT2LMHeadModel(config)``
    (the tied ``lm_head.weight`` is written once, as ``transformer.wte.weight``)."""
    import transformers

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    return [(n, tuple(t.shape)) for n, t in model.state_dict().items() if n not in tied]


def _shards(layout: list[tuple[str, tuple[int, ...]]], itemsize: int, limit: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for name, shape in layout:
        n = itemsize
        for d in shape:
            n *= d
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


def write(out: str, config: object, dtype: torch.dtype, max_shard_bytes: int) -> dict[str, int]:
    """Write the checkpoint into ``out``; returns ``{"files": N, "bytes": tensor bytes}``."""
    from zero_core.checkpoint.tensor_file import TensorEntry, write_tensor_file

    os.makedirs(out, exist_ok=True)
    layout = gpt2_layout(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    from zero.offload import check_free_space

    need = sum(itemsize * math.prod(s) for _, s in layout)  # plus 1 % and 16 MiB for headers
    check_free_space(out, int(need * 1.01) + (16 << 20), "write_random_gpt2: the safetensors shards")
    shards = _shards(layout, itemsize, max_shard_bytes)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        entries = [
            TensorEntry(n, s, dtype, lambda n=n, s=s: tensor_values(n, s, dtype), temporary=True)
            for n, s in shard
        ]
        write_tensor_file(os.path.join(out, fname), entries, metadata={"format": "pt"})
        for n, s in shard:
            weight_map[n] = fname
            total += itemsize * math.prod(s)
        print(f"[write_random_gpt2] {fname}: {len(shard)} tensors", flush=True)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config.save_pretrained(out)
    return {"files": len(shards), "bytes": total}


def main(argv: list[str] | None = None) -> int:
    import transformers

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="directory to write (created)")
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=50257)
    p.add_argument("--n_positions", type=int, default=1024)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--max_shard_gb", type=float, default=2.0)
    args = p.parse_args(argv)
    config = transformers.GPT2Config(
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        vocab_size=args.vocab_size,
        n_positions=args.n_positions,
        tie_word_embeddings=True,
        bos_token_id=min(50256, args.vocab_size - 1),
        eos_token_id=min(50256, args.vocab_size - 1),
    )
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from rss_phases import PhaseMeter

    gpt2_layout(config)  # transformers' GPT-2 code imported before the measured phase
    meter = PhaseMeter()
    with meter.phase("write"):
        done = write(args.out, config, _DTYPES[args.dtype], int(args.max_shard_gb * 1e9))
    meter.close()
    ph = meter.phases[-1]
    print(
        json.dumps(
            {
                "write": done,
                "seconds": round(ph.seconds, 1),
                "peak_growth_bytes": ph.peak - meter.base,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
