"""The largest examples/ GPT that 2 ranks on this machine train under a memory ceiling, per mode.

For zero (stages 0-3, stage 3 + CPU offload of the optimizer, + of the parameters, + NVMe offload
of both), DeepSpeed 0.19.8 with the same JSON configs (its own venv, ``DS_ACCELERATOR=cpu``) and
FSDP2 (``fully_shard``, plain and with ``CPUOffloadPolicy``), find the largest GPT that completes
2 training steps on 2 ranks while the sum of the ranks' peak RSS stays under ``--ceiling-gib``.

Model family: the examples/ GPT (byte vocabulary, learned positions, tied head) at a fixed width
(``--width``, heads of 64) scaled in depth. Depth, not width: the largest single parameter (the
MLP's 4w x w matrix) stays the same for every candidate, so the per-layer knobs of the stage-3
config (prefetch bucket, live parameters, optimizer sub-group, NVMe swap buffer size) mean the
same thing at every size and the size steps are even (12 w^2 parameters a block); the search's
variable is then one integer, the number of blocks. See [Note: one config for every system] in
_gpt_job.py for the configs, [Note: memory ceiling of a benchmark job] in _memwatch.py for how
the ceiling is enforced and [Note: largest-model search] in _limit_search.py for the search.

Estimates (the column beside each measured limit): zero-profiler's model-state bytes per mode
(``zero_paper_model_states_bytes`` for stages 0-3 and FSDP2; ``zero3_rows`` for the CPU offload
rows, ``additional_buffer_factor`` 1; for NVMe, the rows' device term 4L per rank plus the swap
buffers the config allows) plus ``estimate_transformer_activation_mem`` (fp32: twice its 16-bit
bytes, no dropout, fused attention) for every rank, on top of the fixed cost the 1-block trial
measures. NVMe trials also need free disk: ``--disk-reserve-gib`` must remain after 20 bytes per
parameter (fp32 parameters, master copy, Adam's two moments, slack).

Usage (a development run on a busy machine, then the real one on a quiet machine):

    python tools/bench/bench_max_model.py --ceiling-gib 3.5 --width 512 --nvme-dir /path/on/disk
    python tools/bench/bench_max_model.py --full-ram --nvme-dir /path/on/disk

Prints one line per trial; writes ``<out>.md``, ``<out>.png`` and ``<out>.trials.jsonl`` (every
trial, reused by ``--resume``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import _gpt_job as job
from _limit_search import Trial, search_limit
from _memwatch import GIB, meminfo, run_job, wait_for_available
from bench_env import ROOT, cpu_model, git_commit

HERE = os.path.dirname(os.path.abspath(__file__))
DISK_BYTES_PER_PARAM = 20
TRIAL_PREFIX = "bench_max_model_trial_"


def gpt_shape(width: int, layers: int, seq_len: int):
    """zero-profiler's TransformerShape of the examples/ GPT (checked against the model by ``check_shape``)."""
    from zero_profiler.transformer_estimates import TransformerShape

    heads = max(1, width // 64)
    return TransformerShape(
        vocab_size=256,
        hidden_size=width,
        num_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
    )


def check_shape(width: int, seq_len: int) -> None:
    """The estimator's parameter count equals the examples/ GPT's (built on the meta device)."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig, num_params

    for layers in (1, 3):
        with torch.device("meta"):
            model = GPT(
                GPTConfig(seq_len=seq_len, d_model=width, n_layers=layers, n_heads=max(1, width // 64))
            )
        want = gpt_shape(width, layers, seq_len).total_params()
        if num_params(model) != want:
            raise RuntimeError(f"estimator counts {want} parameters, the GPT has {num_params(model)}")


def state_bytes(mode: str, params: int, largest: int, width: int, world: int) -> float:
    """zero-profiler's model-state bytes of ``mode``, all ranks together (see the module docstring)."""
    from zero_profiler.memory_estimators import zero3_rows, zero_paper_model_states_bytes

    if mode in ("stage0", "stage1", "stage2", "stage3"):
        return world * zero_paper_model_states_bytes(params, world, int(mode[-1]))
    if mode in ("fsdp2", "fsdp2+cpu-offload"):
        gathered = 4 * largest if mode == "fsdp2+cpu-offload" else 0
        return world * (zero_paper_model_states_bytes(params, world, 3) + gathered)
    rows = zero3_rows(params, largest, num_gpus_per_node=world, num_nodes=1, additional_buffer_factor=1.0)
    if mode == "stage3+opt-cpu":
        row = next(
            r for r in rows if r.offload_param == "none" and r.offload_optimizer == "cpu" and r.zero_init
        )
        return world * row.gpu_bytes + row.cpu_bytes
    if mode == "stage3+opt-cpu+param-cpu":
        row = next(r for r in rows if r.offload_param == "cpu" and r.zero_init)
        return world * row.gpu_bytes + row.cpu_bytes
    if mode == "stage3+nvme":  # states on disk: the gathered block and the swap buffers stay
        buffers = 4 * (
            job.PARAM_BUFFERS * job.largest_param(width) + 3 * job.OPT_BUFFERS * job.block_params(width)
        )
        return world * (4 * largest + buffers)
    raise ValueError(f"state_bytes: unknown mode {mode!r}")


def estimator(mode: str, width: int, seq_len: int, micro_batch: int, world: int):
    """``n -> estimated bytes`` of a job at ``n`` blocks: model states plus fp32 activations, all ranks."""
    from zero_profiler.transformer_estimates import estimate_transformer_activation_mem

    def estimate(layers: int) -> float:
        shape = gpt_shape(width, layers, seq_len)
        act = estimate_transformer_activation_mem(
            width,
            layers,
            shape.num_attention_heads,
            seq_len,
            micro_batch,
            dropout=False,
            flash_attention=True,
        )
        return (
            state_bytes(mode, shape.total_params(), shape.largest_layer_params(), width, world)
            + world * 2 * act
        )

    return estimate


def disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class TrialRunner:
    """Runs (or reuses from the log) one verified trial: waits for memory, checks disk, cleans up."""

    def __init__(self, args: argparse.Namespace, ceiling: int) -> None:
        self.args, self.ceiling = args, ceiling
        self.log_path = args.out + ".trials.jsonl"
        # every logged run of a size, in order: the k-th request of a size reuses its k-th run
        # (a confirmation run is a new run, not the first one again)
        self.done: dict[tuple, list[dict]] = {}
        self.asked: dict[tuple, int] = {}
        if args.resume and os.path.exists(self.log_path):
            with open(self.log_path) as f:
                for line in f:
                    rec = json.loads(line)
                    self.done.setdefault(self._key(rec["system"], rec["mode"], rec["layers"]), []).append(rec)
        elif os.path.exists(self.log_path):
            os.remove(self.log_path)

    def _key(self, system: str, mode: str, layers: int) -> tuple:
        a = self.args
        return (system, mode, layers, a.width, a.seq_len, a.micro_batch, self.ceiling)

    def __call__(self, system: str, mode: str, layers: int) -> Trial:
        params = gpt_shape(self.args.width, layers, self.args.seq_len).total_params()
        key = self._key(system, mode, layers)
        k = self.asked[key] = self.asked.get(key, 0) + 1
        logged = self.done.get(key, [])
        rec = logged[k - 1] if k <= len(logged) else None
        if rec is None:
            rec = self._run(system, mode, layers, params)
            rec.update(
                system=system, mode=mode, layers=layers, width=self.args.width, seq_len=self.args.seq_len
            )
            rec.update(micro_batch=self.args.micro_batch, ceiling=self.ceiling, params=params)
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        else:
            rec["reused"] = True
        peak = rec.get("peak")
        print(
            f"[bench_max_model] {system} {mode}: {layers} blocks ({params / 1e6:.1f}M params) {rec['status']}"
            f"{' (from the log)' if rec.get('reused') else ''} in {rec.get('seconds', 0):.0f} s, "
            f"peak {peak / GIB if peak else 0:.2f} GiB of {self.ceiling / GIB:.2f}"
            f"{': ' + rec['reason'] if rec.get('reason') else ''}",
            flush=True,
        )
        return Trial(layers, rec["status"], peak, rec.get("seconds", 0.0), rec.get("reason", ""), rec)

    def _run(self, system: str, mode: str, layers: int, params: int) -> dict:
        a = self.args
        nvme = None
        if mode == "stage3+nvme":
            need = DISK_BYTES_PER_PARAM * params + int(a.disk_reserve_gib * GIB)
            free = disk_free(a.nvme_dir)
            if free < need:
                return {
                    "status": "disk",
                    "peak": None,
                    "reason": f"{a.nvme_dir} has {free / GIB:.1f} GiB free, the trial needs {need / GIB:.1f} "
                    f"(20 B/param + {a.disk_reserve_gib} GiB reserve)",
                }
            nvme = os.path.join(a.nvme_dir, f"{TRIAL_PREFIX}{os.getpid()}")
        for attempt in range(3):
            waited = wait_for_available(self.ceiling + int(a.min_available_gib * GIB), a.max_wait)
            if nvme:
                os.makedirs(nvme)
            try:
                cmds, envs = job.commands(
                    system, mode, layers, a.width, a.seq_len, a.micro_batch, a.world, nvme, a.ds_python
                )
                res = run_job(
                    cmds,
                    envs,
                    self.ceiling,
                    a.trial_timeout,
                    min_available=int(a.min_available_gib * GIB / 2),
                    cwd=ROOT,
                )
            finally:
                if nvme:
                    shutil.rmtree(nvme, ignore_errors=True)
            if res.status != "low-memory":
                break
            print(f"  stopped: {res.reason}; retrying ({attempt + 1}/3)", flush=True)
        return _trial_record(res, waited)


def _trial_record(res, waited: float) -> dict:
    rec = {
        "status": res.status,
        "reason": res.reason,
        "seconds": res.seconds,
        "waited_s": waited,
        "peak": res.peak_sum,
        "peak_rss_sum": res.peak_rss_sum,
        "peak_anon_sum": res.peak_anon_sum,
        "cgroup_peak": res.cgroup_peak,
        "rank_peaks": [r.get("peak_rss") for r in res.results],
    }
    if res.results:
        r0 = res.results[0]
        rec.update(
            versions=r0["versions"],
            build_s=r0["build_s"],
            init_s=r0["init_s"],
            step_s=[s["wall"] for s in r0["steps"]],
            losses=[s["loss"] for s in r0["steps"]],
        )
    if res.status != "ok":  # where the job was when it stopped
        done = min(len(re.findall(r"^\[rank \d+\] step \d+:", o, re.M)) for o in res.outputs)
        rec["reason"] += (
            f"; stopped {'before the first step ended' if done == 0 else f'after {done} step(s)'}"
        )
        rec["last_lines"] = [(o.strip().splitlines() or [""])[-1][-300:] for o in res.outputs]
    if res.status in ("failed", "timeout"):
        rec["output_tail"] = "\n".join(o[-1500:] for o in res.outputs)
    return rec


def prewarm_deepspeed(ds_python: str, timeout: float = 3600.0) -> float:
    """JIT-build DeepSpeed's CPU Adam, fused Adam and async I/O ops once, outside any watched trial.

    Cached after the first time (~4 min on an idle 2-core machine, far longer on a busy one). The
    build (ninja and its compilers) runs in its own session, killed as a whole past ``timeout``.
    """
    code = (
        "from deepspeed.accelerator import get_accelerator as g\n"
        "for name in ('CPUAdamBuilder', 'FusedAdamBuilder', 'AsyncIOBuilder'):\n"
        "    g().create_op_builder(name).load(verbose=False)\n"
    )
    t0 = time.perf_counter()
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen(
        [ds_python, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"building DeepSpeed's ops took more than {timeout:.0f} s") from None
    if proc.returncode:
        raise RuntimeError(f"building DeepSpeed's ops failed:\n{out[-3000:]}")
    return time.perf_counter() - t0


def modes_of(system: str, wanted: list[str] | None) -> list[str]:
    return [m for m in job.SYSTEMS[system] if wanted is None or m in wanted]


def run_searches(args: argparse.Namespace, ceiling: int) -> list[dict]:
    """Every (system, mode) search, zero and DeepSpeed alternating mode by mode, then FSDP2."""
    runner = TrialRunner(args, ceiling)
    order = []
    for mode in job.ZERO_MODES + job.FSDP_MODES:
        order += [(s, mode) for s in args.systems if mode in modes_of(s, args.modes)]
    searches = []
    for system, mode in order:
        print(f"[bench_max_model] === {system} {mode} ===", flush=True)
        res = search_limit(
            lambda n, system=system, mode=mode: runner(system, mode, n),
            ceiling=ceiling,
            estimate_bytes=estimator(mode, args.width, args.seq_len, args.micro_batch, args.world),
            max_layers=args.max_layers,
            tolerance=args.tolerance,
            confirm=args.confirm,
        )
        print(
            f"[bench_max_model] {system} {mode}: limit {res.limit} blocks ({res.bound}), "
            f"estimator predicted {res.prediction}",
            flush=True,
        )
        searches.append({"system": system, "mode": mode, "result": res})
    return searches


def _versions(searches: list[dict]) -> dict:
    out = {}
    for s in searches:
        for t in s["result"].trials:
            out.update(t.info.get("versions") or {})
    return out


def write_results(
    args: argparse.Namespace, ceiling: int, searches: list[dict], command: str, wall: float
) -> str:
    import _max_model_report as report

    def params_of(n: int) -> int:
        return gpt_shape(args.width, n, args.seq_len).total_params()

    rows = report.summarize(searches, params_of)
    modes = list(job.ZERO_MODES + job.FSDP_MODES)
    mi = meminfo()
    v = _versions(searches)
    title = f"bench_max_model: largest examples/ GPT per mode, 2 ranks, ceiling {ceiling / GIB:.2f} GiB"
    png = args.out + ".png"
    report.plot(rows, modes, ceiling, png, title.split(": ", 1)[1])
    per_block = params_of(2) - params_of(1)
    lines = [
        f"# {title}",
        "",
        f"**{args.label}**" if args.label else "",
        "",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), RAM {mi['MemTotal'] / GIB:.1f} GiB, {platform.platform()}",
        f"- versions: python {v.get('python', '?')}, torch {v.get('torch', '?')}, zero {v.get('zero', '?')}, "
        f"DeepSpeed {v.get('deepspeed', 'not run')} (own venv, DS_ACCELERATOR=cpu)",
        f"- git commit: {args.commit} (when the run started)",
        f"- command: `{command}`",
        f"- ceiling: {ceiling / GIB:.2f} GiB for the sum of both ranks' peak RSS (VmHWM), watched every 0.1 s, "
        f"job killed past it; backstop: {'a memory cgroup at 1.05x the ceiling' if _cgroup_ok() else 'none (no writable memory cgroup)'}. "
        "See [Note: memory ceiling of a benchmark job] in tools/bench/_memwatch.py",
        f"- model: examples/ GPT scaled in depth at width {args.width} ({max(1, args.width // 64)} heads of 64), "
        f"seq_len {args.seq_len}, micro-batch {args.micro_batch} per rank, vocabulary 256, tied head; "
        f"{per_block / 1e6:.2f}M parameters per block, {params_of(1) / 1e6:.2f}M at 1 block; fp32, Adam; "
        "2 training steps per trial",
        "- configs: the same DeepSpeed JSON for zero and DeepSpeed per mode ([Note: one config for every system] in "
        "tools/bench/_gpt_job.py); FSDP2: fully_shard per block and at the root, torch.optim.Adam",
        f"- search: 1 block first (fixed cost), then the estimator's prediction, then a line through the "
        f"measured peaks, safeguarded bisection; stops at a bracket of max(1, {args.tolerance} x limit) blocks "
        f"or at --max-layers {args.max_layers}; the limit ran {1 + args.confirm} times, passing every time "
        "([Note: largest-model search] in tools/bench/_limit_search.py)",
        "- estimator: zero-profiler's model-state bytes per mode plus fp32 activations, on top of the 1-block "
        "trial's measured fixed cost (module docstring of bench_max_model.py)",
        f"- total wall time {wall / 60:.0f} min; 1-min load average at the end {os.getloadavg()[0]:.1f}",
        "",
        "## Parameters per mode and system",
        "",
        *report.matrix_table(rows, modes),
        "",
        f"![plot]({os.path.basename(png)})",
        "",
        "## Each search",
        "",
        *report.detail_table(rows),
        "",
        "## Every trial",
        "",
        *report.trials_table(searches),
        "",
        "## Re-running",
        "",
        "On a quiet machine (nothing else running), with the whole RAM less an OS reserve as the ceiling:",
        "",
        "```",
        f"{QUIET_COMMAND}",
        "```",
        "",
    ]
    text = "\n".join(lines)
    from zero_core.checkpoint.atomic import atomic_write_text

    atomic_write_text(args.out + ".md", text)
    return text


QUIET_COMMAND = (
    "python tools/bench/bench_max_model.py --full-ram --width 1024 --nvme-dir /path/on/the/nvme/disk "
    "--ds-python /path/to/deepspeed/venv/bin/python"
)


def _cgroup_ok() -> bool:
    from _memwatch import CGROUP_ROOT

    return os.access(CGROUP_ROOT, os.W_OK)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--ceiling-gib", type=float, help="memory ceiling for the sum of the ranks' peak RSS")
    g.add_argument("--full-ram", action="store_true", help="ceiling = MemTotal - --os-reserve-gib")
    ap.add_argument("--os-reserve-gib", type=float, default=2.5, help="RAM left to the OS with --full-ram")
    ap.add_argument(
        "--min-available-gib",
        type=float,
        default=None,
        help="a trial starts once MemAvailable >= ceiling + this, and stops if MemAvailable falls "
        "under half of it (default 4, or 0.5 with --full-ram)",
    )
    ap.add_argument("--systems", default="zero,deepspeed,fsdp2")
    ap.add_argument("--modes", default=None, help="comma-separated subset of the modes (default: all)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--max-layers", type=int, default=256)
    ap.add_argument(
        "--tolerance", type=float, default=0.05, help="stop at a bracket of this fraction of the limit"
    )
    ap.add_argument(
        "--confirm",
        type=int,
        default=1,
        help="extra runs of the limit that must pass too (peaks vary by a few %%)",
    )
    ap.add_argument("--trial-timeout", type=float, default=3600.0)
    ap.add_argument(
        "--max-wait", type=float, default=3600.0, help="longest wait for free memory before a trial"
    )
    ap.add_argument("--nvme-dir", default=os.path.join(ROOT, ".bench_nvme_tmp"))
    ap.add_argument("--disk-reserve-gib", type=float, default=5.0)
    ap.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_max_model"))
    ap.add_argument(
        "--label", default="", help="a line at the top of the results file (e.g. the machine's state)"
    )
    ap.add_argument("--resume", action="store_true", help="reuse the trials already in <out>.trials.jsonl")
    args = ap.parse_args(argv)
    args.world = 2
    args.systems = [s for s in args.systems.split(",") if s]
    args.modes = args.modes.split(",") if args.modes else None
    bad = [s for s in args.systems if s not in job.SYSTEMS]
    known = set(job.ZERO_MODES + job.FSDP_MODES)
    if bad or (args.modes and not set(args.modes) <= known):
        ap.error(f"--systems from {sorted(job.SYSTEMS)}, --modes from {sorted(known)}")
    if args.min_available_gib is None:
        args.min_available_gib = 0.5 if args.full_ram else 4.0
    if args.width < 64 or args.width % 64 or args.max_layers < 1 or args.tolerance < 0:
        ap.error("--width must be a multiple of 64, --max-layers >= 1, --tolerance >= 0")
    if "deepspeed" in args.systems and not os.access(args.ds_python, os.X_OK):
        ap.error(f"--ds-python {args.ds_python} is not an executable (DeepSpeed's venv python)")
    return args


def _ceiling(args: argparse.Namespace) -> int:
    if args.full_ram:
        quarter = GIB // 4
        return (meminfo()["MemTotal"] - int(args.os_reserve_gib * GIB)) // quarter * quarter
    if args.ceiling_gib <= 0:
        raise SystemExit("--ceiling-gib must be > 0")
    return int(args.ceiling_gib * GIB)


def _prepare_nvme(path: str) -> None:
    """Create the swap folder, remove trial folders a killed run of this script left, clean up at exit."""
    os.makedirs(path, exist_ok=True)

    def clean() -> None:
        for name in os.listdir(path):
            if name.startswith(TRIAL_PREFIX):
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)

    clean()
    atexit.register(clean)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.commit = git_commit("tools/bench", "packages", "examples")  # the code measured, before any edit
    ceiling = _ceiling(args)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # run the cleanups (kill the job, remove swap files)
    command = shlex.join(
        ["python", "tools/bench/bench_max_model.py", *(argv if argv is not None else sys.argv[1:])]
    )
    check_shape(args.width, args.seq_len)
    if any(m == "stage3+nvme" for s in args.systems for m in modes_of(s, args.modes)):
        _prepare_nvme(args.nvme_dir)
        print(
            f"[bench_max_model] swap folder {args.nvme_dir}: {disk_free(args.nvme_dir) / GIB:.0f} GiB free",
            flush=True,
        )
    if "deepspeed" in args.systems:
        print("[bench_max_model] building DeepSpeed's ops (cached after the first time) ...", flush=True)
        print(
            f"[bench_max_model] DeepSpeed's ops ready in {prewarm_deepspeed(args.ds_python):.0f} s",
            flush=True,
        )
    print(
        f"[bench_max_model] ceiling {ceiling / GIB:.2f} GiB, width {args.width}, systems {args.systems}, "
        f"MemAvailable {meminfo()['MemAvailable'] / GIB:.1f} GiB",
        flush=True,
    )
    t0 = time.perf_counter()
    searches = run_searches(args, ceiling)
    print(write_results(args, ceiling, searches, command, time.perf_counter() - t0))


if __name__ == "__main__":
    main()
