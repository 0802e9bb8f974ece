"""Fused BERT layer (zero_ops.transformer) vs Hugging Face's BertLayer: time and saved activations.

One BERT-base layer (hidden 768, 12 heads, intermediate 3072, sequence 128, batch 8, dropout 0.1
in training mode, as BERT pre-training runs it), fp32 on CPU, forward + backward of
``out.sum()``. Variants, all holding the same weights:

- ``hf_eager`` / ``hf_sdpa``: ``transformers``' ``BertLayer`` with ``attn_implementation``
  "eager" / "sdpa"; ``hf_eager_compiled``: the eager one under ``torch.compile``;
- ``ours``: ``TransformerLayer`` (replace_bert_layers of the same model), default switches;
  ``ours_compiled``: the same under ``torch.compile``; ``ours+<switch>``: one memory switch on;
  ``ours+all``: the three switches on; ``ours_stochastic``: ``stochastic_mode`` (attention in
  ``scaled_dot_product_attention`` with its own dropout).

Timing: CPU time of the benchmark thread (``time.thread_time``; OMP_NUM_THREADS=1 puts all the
work on it), so time spent waiting for a core on the loaded machine is not counted. Reps are
interleaved (rep 1 of every variant, then rep 2, ...) and each variant's rep is divided by the
``hf_eager`` rep of the same round: the table gives median times, their interquartile range, and
the median of those paired ratios with its IQR.

Memory: saved-activation bytes per layer, measured with ``saved_tensors_hooks`` as the marginal
cost of a layer in a stack (two layers minus one; see zero_ops.transformer.memory), and for each
switch the bytes it saved (ours minus ours+switch) against ``stated_savings``.

Run: OMP_NUM_THREADS=1 hatch run python tools/bench/bench_transformer.py --out tools/bench/results/bench_transformer.md
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import torch
import transformers
from bench_env import cpu_model, git_commit
from transformers.models.bert.modeling_bert import BertLayer
from zero_ops.transformer import TransformerLayer, layer_saved_bytes, replace_bert_layers, stated_savings

clock = time.thread_time  # see the module docstring
SWITCHES = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")


class _Holder(torch.nn.Module):
    """The two things replace_bert_layers needs: a .config and BertLayer children."""

    def __init__(self, config: transformers.BertConfig, layer: torch.nn.Module) -> None:
        super().__init__()
        self.config = config
        self.layer = torch.nn.ModuleList([layer])


def bert_config(args: argparse.Namespace, attn: str) -> transformers.BertConfig:
    return transformers.BertConfig(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=12,
        hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout,
        attn_implementation=attn,
    )


def build_variants(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    eager = BertLayer(bert_config(args, "eager"))
    sdpa = BertLayer(bert_config(args, "sdpa"))
    sdpa.load_state_dict(eager.state_dict())

    def fused(**switches: bool) -> torch.nn.Module:
        holder = replace_bert_layers(_Holder(bert_config(args, "eager"), copy.deepcopy(eager)), **switches)
        return holder.layer[0]

    variants = {"hf_eager": eager, "hf_sdpa": sdpa, "ours": fused()}
    for s in SWITCHES:
        variants[f"ours+{s}"] = fused(**{s: True})
    variants["ours+all"] = fused(**dict.fromkeys(SWITCHES, True))
    variants["ours_stochastic"] = fused(stochastic_mode=True)
    if not args.no_compile:
        variants["hf_eager_compiled"] = torch.compile(copy.deepcopy(eager))
        variants["ours_compiled"] = torch.compile(fused())
    for m in variants.values():
        m.train()
    return variants


def fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor) -> None:
    out = layer(x, mask)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()


def time_variants(variants: dict, x: torch.Tensor, mask: torch.Tensor, reps: int) -> dict[str, list[float]]:
    for name, layer in variants.items():  # warm-up (compiles the compiled ones)
        t0 = time.perf_counter()
        for _ in range(2):
            fwd_bwd(layer, x, mask)
        print(f"warm-up {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    times: dict[str, list[float]] = {n: [] for n in variants}
    for rep in range(reps):
        for name, layer in variants.items():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            t0 = clock()
            fwd_bwd(layer, x, mask)
            times[name].append(clock() - t0)
        print(f"rep {rep + 1}/{reps}: " + " ".join(f"{n}={t[-1]:.3f}" for n, t in times.items()), flush=True)
    return times


def quartiles(v: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return q[0], statistics.median(v), q[2]


def memory_rows(variants: dict, x: torch.Tensor, mask: torch.Tensor) -> dict[str, int]:
    out = {}
    for name, layer in variants.items():
        if name.endswith("_compiled"):
            continue  # compiled graphs save what inductor decides; not the layer's own choice
        out[name] = layer_saved_bytes(lambda layer=layer: copy.deepcopy(layer), x, mask)
    return out


def render(args, variants, times, saved, stated, load_before, load_after, command) -> str:
    base = times["hf_eager"]
    lines = [
        "# bench_transformer: fused BERT layer vs Hugging Face BertLayer",
        "",
        f"- command: `{command}`",
        f"- commit: {git_commit('packages/zero-ops', 'tools/bench/bench_transformer.py')}",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.platform()}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}",
        f"- OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch threads {torch.get_num_threads()}",
        f"- load average before / after: {load_before} / {load_after} (machine shared with other jobs: "
        "compare ratios, not absolute times)",
        f"- shapes: batch {args.batch}, seq {args.seq}, hidden {args.hidden}, heads {args.heads}, "
        f"intermediate {4 * args.hidden}, dropout {args.dropout}, training mode, fp32, padding mask on "
        f"half the batch; {args.reps} interleaved reps",
        "",
        "## forward + backward time per layer (thread CPU time)",
        "",
        "| variant | median s | IQR s | time / hf_eager (median of paired ratios) | IQR of ratio | speed-up vs hf_eager |",
        "|---|---|---|---|---|---|",
    ]
    for name, t in times.items():
        lo, med, hi = quartiles(t)
        ratios = [a / b for a, b in zip(t, base, strict=True)]
        rlo, rmed, rhi = quartiles(ratios)
        lines.append(
            f"| {name} | {med:.3f} | {lo:.3f}-{hi:.3f} | {rmed:.3f} | {rlo:.3f}-{rhi:.3f} | {1 / rmed:.2f}x |"
        )
    lines += [
        "",
        "## saved activations per layer (saved_tensors_hooks, marginal layer of a stack)",
        "",
        "| variant | saved MiB | vs hf_eager |",
        "|---|---|---|",
    ]
    for name, b in saved.items():
        lines.append(f"| {name} | {b / 2**20:.2f} | {b / saved['hf_eager']:.3f} |")
    lines += [
        "",
        "## bytes each switch saves (ours minus ours+switch) vs stated",
        "",
        "| switch | measured MiB | stated MiB | measured / stated |",
        "|---|---|---|---|",
    ]
    for s in SWITCHES:
        got = saved["ours"] - saved[f"ours+{s}"]
        want = stated[s]
        lines.append(f"| {s} | {got / 2**20:.3f} | {want / 2**20:.3f} | {got / want:.4f} |")
    got_all, want_all = saved["ours"] - saved["ours+all"], sum(stated.values())
    lines.append(f"| all three | {got_all / 2**20:.3f} | {want_all / 2**20:.3f} | {got_all / want_all:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--out", default=None, help="write the results table (markdown) here")
    args = p.parse_args()
    command = "OMP_NUM_THREADS=1 python tools/bench/bench_transformer.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "no_compile")
    )
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    variants = build_variants(args)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=g, requires_grad=True)
    mask = torch.zeros(args.batch, 1, 1, args.seq)
    mask[args.batch // 2 :, ..., args.seq * 3 // 4 :] = torch.finfo(torch.float32).min  # padded tail
    saved = memory_rows(variants, x, mask)
    ours: TransformerLayer = variants["ours"]
    stated = stated_savings(ours.config, args.batch, args.seq)
    times = time_variants(variants, x, mask, args.reps)
    load_after = " ".join(f"{x:.1f}" for x in os.getloadavg())
    text = render(args, variants, times, saved, stated, load_before, load_after, command)
    print(text)
    if args.out:
        from zero_core.checkpoint.atomic import atomic_write_text

        atomic_write_text(args.out, text)


if __name__ == "__main__":
    main()
