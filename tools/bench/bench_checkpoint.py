"""Checkpoint save/load/convert benchmark: zero vs DeepSpeed on the same ~100M-parameter model.

Run:  OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_checkpoint.py [--ds-python /tmp/dsvenv/bin/python]

Measures in one run, repetitions interleaved (zero, DeepSpeed, dd, ...; see [Note: interleaving]): the
disk's sequential write (dd conv=fdatasync) and read (dd iflag=direct) bandwidth; zero's save and load
(2 ranks, gloo, stages 2 and 3; median of --reps; loads warm and cold, see [Note: cold-cache loads]) with
bytes on disk; the conversion (the zero_to_fp32.py copied in the checkpoint, run as a user would) time
and peak RSS, on the 100M checkpoint and on a synthetic >= 200M-parameter one; the same model
under DeepSpeed (its save_checkpoint and its zero_to_fp32) when its venv exists. Writes
tools/bench/results/bench_checkpoint.md.
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
import tempfile
import textwrap
import threading
import time

import torch
from bench_env import cpu_model, git_commit

WIDTH, DEPTH = 2048, 24  # 24 x (2048*2048 + 2048) = 100.7M parameters
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def _input() -> torch.Tensor:
    return torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(1))


def _reference() -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch: the same model, input and one Adam step as every engine here."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(_input()).pow(2).mean().backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _verify_output(files: list[str], ref: dict[str, torch.Tensor], who: str) -> float:
    """Check a converted fp32 state dict: files exist, same tensors and numel as the model, values match.

    Returns the largest absolute difference to the reference; raises if anything is off.
    """
    from safetensors import safe_open

    if not files or not all(os.path.isfile(f) for f in files):
        raise RuntimeError(f"{who}: conversion output missing: {files}")
    got: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                got[k] = sf.get_tensor(k)
    if set(got) != set(ref):
        raise RuntimeError(f"{who}: output tensors {sorted(set(got) ^ set(ref))[:6]} differ from the model's")
    if sum(t.numel() for t in got.values()) != sum(t.numel() for t in ref.values()):
        raise RuntimeError(f"{who}: output numel differs from the model's")
    worst = 0.0
    for k, v in ref.items():
        if (
            got[k].dtype != torch.float32
            or got[k].shape != v.shape
            or not torch.allclose(got[k], v, rtol=1e-5, atol=1e-7)
        ):
            raise RuntimeError(f"{who}: tensor {k} differs from the PyTorch reference")
        worst = max(worst, (got[k] - v).abs().max().item())
    return worst


def _cfg(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage},
    }


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _cached_bytes() -> int:
    """``Cached`` of /proc/meminfo: the page cache's size, system-wide."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no Cached line")


def _evict(path: str) -> int:
    """fsync every file under ``path`` and drop its pages from the page cache (no root needed).

    [Note: cold-cache loads]
    A load right after a save reads the files from the page cache, while dd's read uses
    O_DIRECT, i.e. the disk. Each rep therefore loads twice: warm (right after the save) and
    cold (after this eviction), for both implementations. ``POSIX_FADV_DONTNEED`` drops only
    clean pages, hence the fsync first (DeepSpeed's torch.save does not fsync). Returns how
    much ``Cached`` fell, reported next to the checkpoint's size as evidence that the pages went.
    """
    before = _cached_bytes()
    for d, _, fs in os.walk(path):
        for f in fs:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return before - _cached_bytes()


def _dd_rate(cmd: list[str]) -> float:
    """Run ``dd`` and return its GB/s ("1073741824 bytes (1.1 GB, 1.0 GiB) copied, 0.9 s, 1.2 GB/s")."""
    r = subprocess.run(["dd", *cmd], capture_output=True, text=True)
    m = re.search(r"(\d+) bytes.*copied, ([\d.]+) s", r.stderr)
    if m is None:
        raise RuntimeError(f"dd {' '.join(cmd)} failed: {r.stderr}")
    return int(m.group(1)) / float(m.group(2)) / 1e9


def _dd_write(path: str) -> float:
    """GB/s of writing 1 GiB to ``path`` with dd, fdatasync included."""
    return _dd_rate(["if=/dev/zero", f"of={path}", "bs=16M", "count=64", "conv=fdatasync"])


def _dd(workdir: str) -> tuple[float, float]:
    """The disk's sequential write and O_DIRECT read bandwidth (GB/s) on a fresh 1 GiB file."""
    path = os.path.join(workdir, "dd.bin")
    try:
        return _dd_write(path), _dd_read(path)
    finally:
        os.unlink(path)


def _dd_read(path: str) -> float:
    """GB/s of one O_DIRECT sequential read of ``path``.

    [Note: bracketing dd reads]
    The disk behind this machine is shared and its read bandwidth drifts by 2-3x within a run
    (runs of 2026-11-22: dd's O_DIRECT read 0.95-2.97 GB/s in one run, 1.2 GB/s medians during the
    stage-2 reps and 2.8 GB/s during the stage-3 reps of the same run), so a cold load compared with
    the run's median dd read says as much about when it ran as about the load. Every cold load is
    therefore also bracketed: rank 0 reads a 1 GiB reference file with dd (O_DIRECT, so the page
    cache plays no part) right before and right after the load, and the load's rate is divided
    by the mean of the two. The table reports the median of these per-rep ratios next to the
    ratio to the run's median.
    """
    return _dd_rate([f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"])


def _wait_turn(ctl: str, name: str, limit: float = 900.0) -> None:
    """Block until the conductor creates ``ctl/name`` (the file handshake that interleaves workers)."""
    deadline = time.monotonic() + limit
    while not os.path.exists(os.path.join(ctl, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name} from the conductor in {limit:.0f} s")
        time.sleep(0.05)


def _signal(ctl: str, name: str) -> None:
    open(os.path.join(ctl, name), "w").close()


def _zero_rank(workdir: str, stage: int, reps: int, ctl: str, dd_ref: str) -> dict:
    """One zero rank, alive for all reps of a stage; rep i runs when the conductor says so."""
    import torch.distributed as dist
    import zero_core

    engine, *_ = zero_core.initialize(model=_model(), config=_cfg(stage))
    engine.backward(engine(_input()).pow(2).mean())
    engine.step()
    rank = dist.get_rank()
    dist.barrier()
    if rank == 0:
        _signal(ctl, "ready_zero")  # See [Note: interleaving]
    saves, loads, cold, evicted, bracket = [], [], [], [], []
    for i in range(reps):
        _wait_turn(ctl, f"go_zero_{i}")
        d = os.path.join(workdir, f"zero_s{stage}_{i}")  # a fresh directory: a first save, not a replace
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(d, tag="t")
        dist.barrier()
        saves.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(d, tag="t")  # warm: the files were just written
        dist.barrier()
        loads.append(time.perf_counter() - t0)
        if rank == 0:
            evicted.append(_evict(d))  # See [Note: cold-cache loads]
            before = _dd_read(dd_ref)  # See [Note: bracketing dd reads]
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(d, tag="t")
        dist.barrier()
        cold.append(time.perf_counter() - t0)
        if rank == 0:
            bracket.append((before, _dd_read(dd_ref)))
            if i:  # keep the last rep's checkpoint for the conversion runs
                shutil.rmtree(os.path.join(workdir, f"zero_s{stage}_{i - 1}"))
            _signal(ctl, f"done_zero_{i}")
    return {"save": saves, "load": loads, "cold": cold, "evicted": evicted, "bracket": bracket}


_RSS_WRAPPER = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    if e.code:\n"
    "        raise\n"
    "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]\n"
    "print('PEAK_RSS_KB', hwm, file=sys.stderr)\n"
)


def _peak_rss_run(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """Wall time and peak RSS (VmHWM, bytes) of ``cmd`` (a python script + args) in a fresh interpreter.

    Raises unless the script exits 0: a failed conversion must never be reported as a fast one.
    """
    t0 = time.perf_counter()
    p = subprocess.run([cmd[0], "-c", _RSS_WRAPPER, *cmd[1:]], capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    m = re.search(r"PEAK_RSS_KB (\d+)", p.stderr)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"{cmd} failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return dt, int(m.group(1)) * 1024


def _synthetic(path: str, numel: int, tensors: int) -> int:
    """A 2-rank checkpoint written directly in the format (fp32 fragments only, no training)."""
    from zero_core.checkpoint.format import FORMAT_VERSION, dumps
    from zero_core.checkpoint.integrity import file_crc32c, file_record
    from zero_core.checkpoint.metadata import sealed_bytes
    from zero_core.checkpoint.tensor_file import TensorEntry, write_tensor_file

    tag = os.path.join(path, "syn")
    os.makedirs(tag, exist_ok=True)
    per = numel // tensors
    names = [f"layer{i}.weight" for i in range(tensors)]
    files = {}
    for r in range(2):
        lo, hi = (0, per // 2) if r == 0 else (per // 2, per)
        frags, entries = [], []
        for i, n in enumerate(names):
            key = f"fp32:{n}:{lo}"
            frags.append(
                {
                    "name": n,
                    "kind": "fp32",
                    "shape": [per],
                    "dtype": "float32",
                    "start": lo,
                    "end": hi,
                    "key": key,
                    "elementwise": True,
                    "python_scalar": False,
                }
            )
            entries.append(
                TensorEntry(key, (hi - lo,), torch.float32, lambda i=i, n=hi - lo: torch.full((n,), float(i)))
            )
        record = write_tensor_file(os.path.join(tag, f"rank_{r:05d}.safetensors"), entries)
        table = {
            "rank": r,
            "world_size": 2,
            "file": f"rank_{r:05d}.safetensors",
            "file_record": record,
            "fragments": frags,
            "rng": {},
            "rng_tensors": [],
        }
        jp = os.path.join(tag, f"rank_{r:05d}.json")
        with open(jp, "wb") as f:
            f.write(dumps(table))
        n, crcs = file_crc32c(jp)
        files[f"rank_{r:05d}.json"] = file_record(n, crc32c=crcs)
    meta = {
        "format": "zero-checkpoint",
        "format_version": FORMAT_VERSION,
        "world_size": 2,
        "files": files,
        "parameters": [[n, True, [per]] for n in names],
        "exclude_frozen_parameters": False,
    }
    with open(os.path.join(tag, "checkpoint.json"), "wb") as f:
        f.write(sealed_bytes(meta))
    shutil.copy(os.path.join(ROOT, "packages/zero-core/src/zero_core/checkpoint/zero_to_fp32.py"), tag)
    with open(os.path.join(path, "latest"), "w") as f:
        f.write("syn")
    return per * tensors


_DS_WORKER = textwrap.dedent(
    """
    import json, os, shutil, sys, time, torch, deepspeed
    import torch.distributed as dist
    stage, out, width, depth = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    reps, ctl, dd_ref = int(sys.argv[5]), sys.argv[6], sys.argv[7]
    import re, subprocess
    def dd_read():  # the bench's _dd_read
        r = subprocess.run(["dd", f"if={dd_ref}", "of=/dev/null", "bs=16M", "iflag=direct"],
                           capture_output=True, text=True)
        m = re.search(r"(\\d+) bytes.*copied, ([\\d.]+) s", r.stderr)
        return int(m.group(1)) / float(m.group(2)) / 1e9
    def wait(name):
        deadline = time.monotonic() + 900
        while not os.path.exists(os.path.join(ctl, name)):
            assert time.monotonic() < deadline, f"no {name} from the conductor"
            time.sleep(0.05)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(1, width, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x).pow(2).mean()); engine.step()
    dist.barrier()
    if dist.get_rank() == 0:
        open(os.path.join(ctl, "ready_ds"), "w").close()
    def cached():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("Cached:"))
    def evict(path):  # the bench's _evict (see [Note: cold-cache loads] there)
        before = cached()
        for d, _, fs in os.walk(path):
            for f in fs:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
                os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
        return before - cached()
    saves, loads, cold, evicted, bracket = [], [], [], [], []
    for i in range(reps):
        wait(f"go_ds_{i}")
        dist.barrier(); t0 = time.perf_counter()
        engine.save_checkpoint(out, tag=f"t{i}")
        dist.barrier(); saves.append(time.perf_counter() - t0)
        dist.barrier(); t0 = time.perf_counter()
        engine.load_checkpoint(out, tag=f"t{i}")
        dist.barrier(); loads.append(time.perf_counter() - t0)
        if dist.get_rank() == 0:
            evicted.append(evict(os.path.join(out, f"t{i}")))
            before = dd_read()
        dist.barrier(); t0 = time.perf_counter()
        engine.load_checkpoint(out, tag=f"t{i}")
        dist.barrier(); cold.append(time.perf_counter() - t0)
        if dist.get_rank() == 0:
            bracket.append((before, dd_read()))
            if i:
                shutil.rmtree(os.path.join(out, f"t{i - 1}"))
            open(os.path.join(ctl, f"done_ds_{i}"), "w").close()
    if dist.get_rank() == 0:
        print("DS_RESULT", json.dumps({"save": saves, "load": loads, "cold": cold, "evicted": evicted,
                                       "bracket": bracket}))
    """
)


def _start_deepspeed(
    ds_python: str, workdir: str, stage: int, reps: int, ctl: str, dd_ref: str
) -> subprocess.Popen:
    script = os.path.join(workdir, "ds_worker.py")
    with open(script, "w") as f:
        f.write(_DS_WORKER)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    args = [str(stage), os.path.join(workdir, f"ds_s{stage}"), str(WIDTH), str(DEPTH), str(reps), ctl, dd_ref]
    return subprocess.Popen(
        [ds_python, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish_deepspeed(
    proc: subprocess.Popen, ds_python: str, workdir: str, stage: int, ref: dict[str, torch.Tensor]
) -> dict:
    stdout, stderr = proc.communicate(timeout=900)
    m = re.search(r"DS_RESULT (.*)", stdout)
    if m is None or proc.returncode != 0:
        raise RuntimeError(f"DeepSpeed stage {stage} failed: {stdout[-2000:]} {stderr[-3000:]}")
    res = json.loads(m.group(1))
    out = os.path.join(workdir, f"ds_s{stage}")
    last = sorted(t for t in os.listdir(out) if t.startswith("t"))[-1]
    res["bytes"] = _du(os.path.join(out, last))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    conv = os.path.join(out, "zero_to_fp32.py")
    fp32_dir = os.path.join(workdir, f"ds_s{stage}_fp32")
    # safetensors output so both tools write the same format; its own default is a torch .bin pickle
    res["convert"] = _peak_rss_run([ds_python, conv, out, fp32_dir, "--safe_serialization"], env=env)
    files = [os.path.join(fp32_dir, f) for f in sorted(os.listdir(fp32_dir)) if f.endswith(".safetensors")]
    res["out_bytes"] = sum(os.path.getsize(f) for f in files)
    res["max_diff"] = _verify_output(files, ref, f"DeepSpeed stage {stage}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(fp32_dir, ignore_errors=True)
    return res


def _catch(fn):
    try:
        return fn()
    except BaseException as e:  # handed to the conductor thread, which re-raises it
        return e


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def _run_stage(stage, args, workdir, ref, have_ds, dd_w, dd_r, loadavg, dd_ref) -> dict:
    """Every rep of one stage, both implementations alive throughout (see [Note: interleaving])."""
    from zero_core.testing import run_multirank

    keys = ["save", "load", "cold", "evicted", "bracket", "conv"]
    s = {k: [] for k in keys + [f"ds_{k}" for k in keys]}
    ctl = tempfile.mkdtemp(prefix="ctl_", dir=workdir)
    ds_proc = _start_deepspeed(args.ds_python, workdir, stage, args.reps, ctl, dd_ref) if have_ds else None
    zero_out: list = []

    def zero_workers() -> None:
        zero_out.append(
            _catch(
                lambda: run_multirank(
                    _zero_rank, 2, args=(workdir, stage, args.reps, ctl, dd_ref), timeout=1800
                )
            )
        )

    zero_thread = threading.Thread(target=zero_workers)
    zero_thread.start()

    def turn(name: str, alive) -> None:
        _signal(ctl, f"go_{name}")
        while not os.path.exists(os.path.join(ctl, f"done_{name}")):
            if not alive():
                raise RuntimeError(f"benchmark worker for {name} exited early: {zero_out or ''}")
            time.sleep(0.05)

    # No rep starts before both implementations finished starting up (imports, model, first step):
    # DeepSpeed's start-up used to overlap zero's first rep (see [Note: interleaving]).
    for name, alive in [("zero", zero_thread.is_alive)] + (
        [("ds", lambda: ds_proc.poll() is None)] if ds_proc is not None else []
    ):
        while not os.path.exists(os.path.join(ctl, f"ready_{name}")):
            if not alive():
                raise RuntimeError(f"benchmark worker {name} exited during start-up: {zero_out or ''}")
            time.sleep(0.05)
    for i in range(args.reps):
        loadavg.append(os.getloadavg()[0])
        turn(f"zero_{i}", zero_thread.is_alive)
        if ds_proc is not None:
            turn(f"ds_{i}", lambda: ds_proc.poll() is None)
        w, r = _dd(workdir)
        dd_w.append(w)
        dd_r.append(r)
    zero_thread.join()
    res = zero_out[0]
    if isinstance(res, BaseException):
        raise res
    for k in ("save", "load", "cold", "evicted", "bracket"):
        s[k] = res[0][k]
    if ds_proc is not None:
        ds = _finish_deepspeed(ds_proc, args.ds_python, workdir, stage, ref)
        s["ds_save"], s["ds_load"], s["ds_conv"] = ds["save"], ds["load"], [ds["convert"]]
        s["ds_cold"], s["ds_evicted"], s["ds_bracket"] = ds["cold"], ds["evicted"], ds["bracket"]
        s["ds_bytes"], s["ds_out_bytes"], s["ds_max_diff"] = ds["bytes"], ds["out_bytes"], ds["max_diff"]
    d = os.path.join(workdir, f"zero_s{stage}_{args.reps - 1}")
    s["bytes"] = _du(os.path.join(d, "t"))
    out = os.path.join(workdir, "out.safetensors")
    script = os.path.join(d, "t", "zero_to_fp32.py")
    for _ in range(args.reps):
        s["conv"].append(_peak_rss_run([sys.executable, script, d, out, "-q"]))
        s["out_bytes"] = os.path.getsize(out)
        s["max_diff"] = _verify_output([out], ref, f"zero stage {stage}")
        os.unlink(out)
    shutil.rmtree(d)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ds-python", default="/tmp/dsvenv/bin/python")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--synthetic-params", type=int, default=210_000_000)
    ap.add_argument(
        "--workdir", default=None, help="scratch directory on the disk to measure (default: a tmp dir)"
    )
    ap.add_argument("--raw", default=None, help="also write every rep's raw timings to this JSON file")
    args = ap.parse_args()

    ref = _reference()
    have_ds = os.path.exists(args.ds_python)
    workdir = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.workdir)
    stats: dict[int, dict[str, list]] = {}
    dd_w, dd_r, conv_rows, loadavg = [], [], [], []
    try:
        # [Note: interleaving] Both implementations stay alive for all reps of a stage (one launch
        # each, so the slow DeepSpeed start-up is paid once) and take turns through a file
        # handshake: zero rep i, DeepSpeed rep i, dd, zero rep i + 1, ... so drift in the shared
        # machine's load hits every column alike. Rep 0 starts only after both launches have
        # finished starting up (each signals ready_<name>), so neither's start-up competes with a rep.
        dd_ref = os.path.join(workdir, "dd_ref.bin")  # See [Note: bracketing dd reads]
        _dd_write(dd_ref)
        for stage in (2, 3):
            stats[stage] = _run_stage(stage, args, workdir, ref, have_ds, dd_w, dd_r, loadavg, dd_ref)
        syn = os.path.join(workdir, "syn")
        n = _synthetic(syn, args.synthetic_params, tensors=12)
        for shard in ("400MB",):
            dt, rss = _peak_rss_run(
                [
                    sys.executable,
                    os.path.join(syn, "syn", "zero_to_fp32.py"),
                    syn,
                    os.path.join(workdir, "sy", "model.safetensors"),
                    "-q",
                    "--max-shard-size",
                    shard,
                ]
            )
            largest = max(
                os.path.getsize(os.path.join(workdir, "sy", f))
                for f in os.listdir(os.path.join(workdir, "sy"))
            )
            conv_rows.append((n, shard, dt, rss, largest))
            shutil.rmtree(os.path.join(workdir, "sy"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump({"stats": stats, "dd_write": dd_w, "dd_read": dd_r, "loadavg": loadavg}, f, indent=1)
    _report(stats, conv_rows, dd_w, dd_r, loadavg, args, have_ds)


def _report(stats, conv_rows, dd_w, dd_r, loadavg, args, have_ds) -> None:
    commit = git_commit("packages/zero-core", "tools/bench/bench_checkpoint.py")
    cpu = cpu_model()
    med = statistics.median
    ds_version = "not run"
    if have_ds:
        ds_version = subprocess.run(
            [args.ds_python, "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    w, r = med(dd_w), med(dd_r)
    lines = [
        "# Checkpoint save / load / conversion (zero vs DeepSpeed)",
        "",
        f"- machine: nproc {os.cpu_count()}, {cpu}, {platform.platform()} (shared, noisy: compare within this run)",
        f"- torch {torch.__version__}, python {platform.python_version()}, deepspeed {ds_version} (own venv, "
        f"DS_ACCELERATOR=cpu), commit {commit or 'uncommitted'} (working tree may hold uncommitted changes)",
        f"- command: `OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_checkpoint.py --reps {args.reps}`",
        f"- model: {DEPTH} x Linear({WIDTH}, {WIDTH}) = {DEPTH * (WIDTH * WIDTH + WIDTH) / 1e6:.1f}M parameters, "
        "fp32, Adam (one step taken on a seeded input), 2 ranks (gloo)",
        f"- one launch per implementation and stage doing all {args.reps} reps, the reps interleaved through a "
        "file handshake (zero rep i, DeepSpeed rep i, dd, zero rep i+1, ...); each rep saves into a fresh "
        "directory, loads it back right away (warm: from the page cache), then fsyncs every checkpoint file, "
        "drops it from the page cache (posix_fadvise DONTNEED) and loads it again (cold: from the disk, as "
        "dd's O_DIRECT read), rank 0 reading a 1 GiB reference file with dd right before and right after each "
        "cold load (see [Note: bracketing dd reads]); median [min-max]",
        f"- 1-minute load average at each rep: median {statistics.median(loadavg):.1f} "
        f"[{min(loadavg):.1f}-{max(loadavg):.1f}] (other engineers' jobs share the 2 cores and the disk)",
        f"- disk sequential bandwidth, same run ({len(dd_w)} samples): write {_spread(dd_w)} GB/s "
        f"(dd bs=16M count=64 conv=fdatasync), read {_spread(dd_r)} GB/s (dd iflag=direct)",
        "- every conversion output is checked: files exist, same tensor names and total numel as the model, "
        "values equal a plain single-process PyTorch run of the same step (allclose rtol 1e-5)",
        "",
    ]
    evict = []
    for stage, s in stats.items():
        evict.append(f"stage {stage} zero {med(s['evicted']) / 1e6:.0f} MB of {s['bytes'] / 1e6:.0f} MB")
        if have_ds:
            evict.append(f"DeepSpeed {med(s['ds_evicted']) / 1e6:.0f} MB of {s['ds_bytes'] / 1e6:.0f} MB")
    lines += [
        "- eviction check: /proc/meminfo Cached fell per eviction (median) by " + ", ".join(evict),
        "",
        "| stage | impl | save s | save GB/s | vs dd write | warm load s | GB/s | vs dd read "
        "| cold load s | GB/s | vs dd read | vs bracketing dd reads | bytes on disk |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stage, s in stats.items():
        impls = [("zero", s["save"], s["load"], s["cold"], s["bytes"], s["bracket"])]
        if have_ds:
            impls.append(
                (
                    f"DeepSpeed {ds_version}",
                    s["ds_save"],
                    s["ds_load"],
                    s["ds_cold"],
                    s["ds_bytes"],
                    s["ds_bracket"],
                )
            )
        for name, sv, ld, cl, nb, br in impls:
            # per rep: the load's rate over the mean of the dd reads around it (see [Note: bracketing dd reads])
            paired = [nb / t / 1e9 / ((a + b) / 2) for t, (a, b) in zip(cl, br)]
            refs = [(a + b) / 2 for a, b in br]
            gs, gl, gc = nb / med(sv) / 1e9, nb / med(ld) / 1e9, nb / med(cl) / 1e9
            lines.append(
                f"| {stage} | {name} | {_spread(sv)} | {gs:.2f} | {gs / w:.0%} | {_spread(ld)} | {gl:.2f} | "
                f"{gl / r:.0%} | {_spread(cl)} | {gc:.2f} | {gc / r:.0%} | {med(paired):.0%} "
                f"[{min(paired):.0%}-{max(paired):.0%}] (dd {_spread(refs)} GB/s) | {nb / 1e6:.0f} MB |"
            )
    lines += [
        "",
        "## Conversion to one fp32 state dict (the script copied into the checkpoint, fresh process, safetensors out)",
        "",
        "| checkpoint | impl | time s | peak RSS (VmHWM) | output | max abs diff vs PyTorch | peak RSS / DeepSpeed's |",
        "|---|---|---|---|---|---|---|",
    ]
    for stage, s in stats.items():
        rss = med([c[1] for c in s["conv"]])
        ds_rss = med([c[1] for c in s["ds_conv"]]) if have_ds else None
        ratio = f"{rss / ds_rss:.2f}" if ds_rss else "n/a"
        lines.append(
            f"| stage {stage}, 100.7M | zero | {_spread([c[0] for c in s['conv']])} | {rss / 1e6:.0f} MB | "
            f"{s['out_bytes'] / 1e6:.0f} MB | {s['max_diff']:.1e} | {ratio} |"
        )
        if have_ds:
            lines.append(
                f"| stage {stage}, 100.7M | DeepSpeed zero_to_fp32 --safe_serialization | "
                f"{_spread([c[0] for c in s['ds_conv']])} | {ds_rss / 1e6:.0f} MB | {s['ds_out_bytes'] / 1e6:.0f} MB | "
                f"{s['ds_max_diff']:.1e} | 1.00 |"
            )
    lines += [
        "",
        "| synthetic checkpoint | --max-shard-size | time s | peak RSS | largest output shard | RSS / shard |",
        "|---|---|---|---|---|---|",
    ]
    for n, shard, dt, rss, largest in conv_rows:
        lines.append(
            f"| {n / 1e6:.0f}M fp32 params, 12 tensors, 2 ranks | {shard} | {dt:.2f} | {rss / 1e6:.0f} MB | "
            f"{largest / 1e6:.0f} MB | {rss / largest:.2f} |"
        )
    lines += [
        "",
        "Peak RSS is the converting process's VmHWM (whole process: interpreter, imports, buffers). zero's",
        "script copies fp32 bytes file to file without importing torch (see [Note: streaming conversion]);",
        "DeepSpeed's imports torch (~0.22 GB here) and materialises each output shard.",
        "",
    ]
    out = os.path.join(ROOT, "tools", "bench", "results", "bench_checkpoint.md")
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
