"""Train and load models larger than this machine's memory; write ``results/train_beyond_ram.md``.

    python tools/bench/bench_beyond_ram.py --train_d_model 2560 --train_layers 26 --train_heads 20 \\
        --hf_n_embd 2560 --hf_layers 24 --hf_heads 20 --nvme_path /work/nvme_swap --scratch /work/bigckpt

runs, one after the other and each on 2 ranks (``zero run``), the two examples of issue 35:

* ``examples/train_gpt_infinity.py``: a GPT built in ``zero.Init(remote_device="nvme")``, five
  steps, checkpoint save and load, ``zero_to_fp32``;
* ``examples/write_random_gpt2.py`` then ``examples/from_pretrained_infinity.py``: a Hugging Face
  GPT-2 checkpoint with random weights (written streaming), loaded by
  ``zero.integrations.from_pretrained`` straight into NVMe partitions, then one forward pass;

with ``--max_rss_gib`` (default: half of this machine's RAM) as the ceiling on every phase's
summed per-rank peak RSS, and renders their JSON results with the machine, versions, commit,
commands, ``dd`` on the swap folder and the figures. ``--render_only`` renders JSON files left by
earlier runs (``--train_json``, ``--write_json``, ``--hf_json``). Checkpoints, fp32 files and the
written GPT-2 go under ``--scratch`` and are deleted at the end; swap files are removed by the
runs themselves. Each run checks the free disk space first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

import bench_env

ROOT = bench_env.ROOT
EXAMPLES = os.path.join(ROOT, "examples")
GIB = 2**30


def _ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024


def _run(cmd: list[str], log: str) -> float:
    print("[bench_beyond_ram] " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    if proc.returncode != 0:
        raise SystemExit(f"bench_beyond_ram: {cmd[0:6]} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start


def _zero_run(script: str, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "zero_core.launcher",
        "run",
        "--nproc",
        "2",
        os.path.join(EXAMPLES, script),
        *args,
    ]


def _dd(folder: str, mib: int = 2048) -> tuple[float, float]:
    """``dd`` O_DIRECT write then read of ``mib`` MiB in ``folder``: (write, read) GB/s."""
    path = os.path.join(folder, ".dd_probe")
    os.makedirs(folder, exist_ok=True)
    rates = []
    try:
        for args in (
            ["if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct"],
            [f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"],
        ):
            start = time.perf_counter()
            subprocess.run(["dd", *args], check=True, capture_output=True)
            rates.append(mib * 2**20 / (time.perf_counter() - start) / 1e9)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return rates[0], rates[1]


def _phase_rows(phases: list[dict], ceiling: float | None) -> list[str]:
    rows = [
        "| phase | wall s | peak RSS per rank (GiB) | sum (GiB) | growth above warm baseline per rank (GiB) |",
        "|---|---|---|---|---|",
    ]
    for p in phases:
        per = p["peak_rss_per_rank"]
        mark = " **over**" if ceiling is not None and sum(per) > ceiling * GIB else ""
        rows.append(
            f"| {p['phase']} | {p['seconds']:.1f} | {' + '.join(f'{v / GIB:.2f}' for v in per)} | "
            f"{sum(per) / GIB:.2f}{mark} | {' + '.join(f'{v / GIB:.2f}' for v in p['peak_growth_per_rank'])} |"
        )
    return rows


_STEP = re.compile(
    r"^\[infinity\] step \d+/\d+ \|.* ([\d.]+) s/step \| swap read ([\d.]+) GB, written ([\d.]+) GB"
)


def _progress_lines(log: str | None) -> list[str]:
    """The training run's per-step progress lines and its held-out losses."""
    if not log or not os.path.exists(log):
        return []
    with open(log) as f:
        return [ln.rstrip() for ln in f if _STEP.match(ln) or ln.startswith("[infinity] held-out loss")]


def _swap_rate_lines(progress: list[str], dd: tuple[float, float] | None) -> list[str]:
    """Median step time and swap throughput of the progress lines, against ``dd`` on the same disk."""
    steps = [tuple(float(v) for v in m.groups()) for ln in progress if (m := _STEP.match(ln))]
    if not steps:
        return []
    secs = statistics.median(s for s, _, _ in steps)
    rate = statistics.median((r + w) / s for s, r, w in steps)
    line = (
        f"Swap traffic per step (both ranks): {steps[0][1]:.2f} GB read + {steps[0][2]:.2f} GB written; "
        f"median step {secs:.1f} s (min {min(s for s, _, _ in steps):.1f}, max {max(s for s, _, _ in steps):.1f}), "
        f"median swap throughput {rate:.2f} GB/s"
    )
    if dd is not None:
        line += f" = {rate / ((dd[0] + dd[1]) / 2):.2f}x dd's mean of write and read ({(dd[0] + dd[1]) / 2:.2f} GB/s)"
    return ["", line + "."]


def render(args: argparse.Namespace, commands: dict[str, str], dd: tuple[float, float] | None) -> str:
    import torch
    import transformers

    train = json.load(open(args.train_json)) if args.train_json and os.path.exists(args.train_json) else None
    hf = json.load(open(args.hf_json)) if args.hf_json and os.path.exists(args.hf_json) else None
    write = json.load(open(args.write_json)) if args.write_json and os.path.exists(args.write_json) else None
    ceiling = args.max_rss_gib
    lines = [
        "# train_beyond_ram: models larger than this machine's memory (issue 35, points 1 and 2)",
        "",
        f"- machine: nproc={os.cpu_count()}, CPU {bench_env.cpu_model()}, RAM {_ram_bytes() / GIB:.1f} GiB, "
        f"{platform.platform()}; {args.load_note} (timings are indicative, memory figures are not affected)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
        f"- git commit: {args.commit or bench_env.git_commit('packages', 'examples')}",
        f"- memory ceiling: the sum of both ranks' peak RSS in every phase at most {ceiling} GiB (half of RAM)",
        "- peak RSS: `VmHWM` reset at each phase start (`/proc/self/clear_refs`) and a 20 ms RSS sampler "
        "(examples/rss_phases.py); growth is above the RSS after a one-step warm-up on a tiny model",
    ]
    if dd is not None:
        lines.append(
            f"- dd O_DIRECT on the swap folder's disk (2 GiB, 1 MiB blocks): write {dd[0]:.2f} GB/s, read {dd[1]:.2f} GB/s"
        )
    for name, cmd in commands.items():
        lines.append(f"- command ({name}): `{cmd}`")
    if train is not None:
        p = train["parameters"]
        lines += [
            "",
            f"## 1. Training a {p / 1e9:.3f}B-parameter GPT (examples/train_gpt_infinity.py)",
            "",
            f"Model states at 16 bytes per parameter: {16 * p / 1e9:.1f} GB ({16 * p / _ram_bytes():.2f}x RAM). "
            f"Swap planned {train['swap_bytes'] / 1e9:.1f} GB, checkpoint {train['checkpoint_bytes'] / 1e9:.1f} GB, "
            f"fp32 file {train['fp32_bytes'] / 1e9:.1f} GB. Swap files left after the run: {train['swap_left_behind']}. "
            f"Phases over the ceiling: {train['over_ceiling'] or 'none'}.",
            "",
            f"Training losses per step: {', '.join(f'{v:.4f}' for v in train['losses'])}; held-out window "
            f"{train['held_out_loss'][0]:.4f} -> {train['held_out_loss'][1]:.4f}.",
            "",
            *_phase_rows(train["phases"], ceiling),
        ]
        progress = _progress_lines(args.train_log)
        if progress:
            lines += [
                "",
                "Progress lines (rank 0):",
                "",
                "```",
                *progress,
                "```",
                *_swap_rate_lines(progress, dd),
            ]
    if hf is not None:
        lines += [
            "",
            f"## 2. A {hf['parameters'] / 1e9:.3f}B-parameter GPT-2 from the Hugging Face format into NVMe partitions",
            "",
            f"Checkpoint: {hf['checkpoint_bytes'] / 1e9:.2f} GB of safetensors shards"
            + (
                f", written by examples/write_random_gpt2.py in {write['seconds']} s with a peak RSS growth of "
                f"{write['peak_growth_bytes'] / 2**20:.0f} MiB (one tensor at a time)"
                if write
                else ""
            )
            + f". Bytes each rank read from them: {', '.join(f'{v / 1e9:.2f} GB' for v in hf['read_bytes_per_rank'])} "
            f"(its half of every tensor). Tensors checked against the writer's values: {len(hf['checked'])}. "
            f"Forward loss of a random sequence: {hf['loss']}. Phases over the ceiling: {hf['over_ceiling'] or 'none'}.",
            "",
            *_phase_rows(hf["phases"], ceiling),
        ]
    if args.note:
        lines += ["", "## Notes", "", *(f"- {n}" for n in args.note)]
    return "\n".join(lines) + "\n"


def run_all(args: argparse.Namespace) -> tuple[dict[str, str], tuple[float, float]]:
    """Run the three programs (training, writing the GPT-2, from_pretrained); their commands and ``dd``."""
    logs = os.path.join(args.scratch, "logs")
    os.makedirs(logs, exist_ok=True)
    args.train_json = os.path.join(logs, "train.json")
    args.hf_json = os.path.join(logs, "hf.json")
    args.write_json = os.path.join(logs, "write.json")
    args.train_log = os.path.join(logs, "train.log")
    dd = _dd(args.nvme_path)
    ceiling = ["--max_rss_gib", str(args.max_rss_gib)]
    train = _zero_run(
        "train_gpt_infinity.py",
        [
            "--d_model",
            str(args.train_d_model),
            "--n_layers",
            str(args.train_layers),
            "--n_heads",
            str(args.train_heads),
        ]
        + ["--nvme_path", args.nvme_path, "--ckpt_dir", os.path.join(args.scratch, "ckpt")]
        + [
            "--fp32_out",
            os.path.join(args.scratch, "fp32"),
            "--results",
            args.train_json,
            "--cleanup",
            *ceiling,
        ],
    )
    _run(train, os.path.join(logs, "train.log"))
    gpt2 = os.path.join(args.scratch, "gpt2")
    write = [
        sys.executable,
        os.path.join(EXAMPLES, "write_random_gpt2.py"),
        gpt2,
        "--n_embd",
        str(args.hf_n_embd),
    ]
    write += ["--n_layer", str(args.hf_layers), "--n_head", str(args.hf_heads)]
    _run(write, os.path.join(logs, "write.log"))
    with open(os.path.join(logs, "write.log")) as f:
        json.dump(json.loads(f.read().strip().splitlines()[-1]), open(args.write_json, "w"))
    hf = _zero_run(
        "from_pretrained_infinity.py",
        [gpt2, "--nvme_path", args.nvme_path, "--forward", "--results", args.hf_json, *ceiling],
    )
    _run(hf, os.path.join(logs, "hf.log"))
    commands = {"train": " ".join(train), "write": " ".join(write), "from_pretrained": " ".join(hf)}
    return commands, dd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_d_model", type=int, default=2560)
    p.add_argument("--train_layers", type=int, default=26)
    p.add_argument("--train_heads", type=int, default=20)
    p.add_argument("--hf_n_embd", type=int, default=2560)
    p.add_argument("--hf_layers", type=int, default=24)
    p.add_argument("--hf_heads", type=int, default=20)
    p.add_argument("--nvme_path", default="/work/nvme_swap")
    p.add_argument(
        "--scratch", default="/work/bigckpt", help="checkpoints and the GPT-2 files (deleted at the end)"
    )
    p.add_argument("--max_rss_gib", type=float, default=None)
    p.add_argument("--out", default=os.path.join(ROOT, "tools", "bench", "results", "train_beyond_ram.md"))
    p.add_argument("--render_only", action="store_true")
    p.add_argument("--train_json", default=None)
    p.add_argument("--write_json", default=None)
    p.add_argument("--hf_json", default=None)
    p.add_argument("--train_log", default=None, help="render: the training run's output (progress lines)")
    p.add_argument("--commit", default=None, help="render: the commit(s) the runs measured (default: HEAD)")
    p.add_argument("--commands_json", default=None, help="render: the commands the JSON files came from")
    p.add_argument("--dd", default=None, help="render: dd's 'write,read' GB/s measured by the runs")
    p.add_argument(
        "--load_note", default="shared with other jobs while measured", help="what else loaded the machine"
    )
    p.add_argument("--note", action="append", default=[], help="a line for the Notes section (repeatable)")
    args = p.parse_args()
    if args.max_rss_gib is None:
        args.max_rss_gib = round(_ram_bytes() / GIB / 2, 1)
    commands: dict[str, str] = json.load(open(args.commands_json)) if args.commands_json else {}
    dd = tuple(float(v) for v in args.dd.split(",")) if args.dd else None
    if not args.render_only:
        commands, dd = run_all(args)
    text = render(args, commands, dd)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    if not args.render_only:
        for name in ("ckpt", "fp32", "gpt2"):
            shutil.rmtree(os.path.join(args.scratch, name), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
