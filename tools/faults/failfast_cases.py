"""Fault injection for issue 37 beyond a failing rank: saves and loads that fail on one rank, are
called on one rank, a user's timeout, a rank ending in the middle of a save, corrupted swap files.

Each case function takes ``full`` and returns rows ``(case, expected, observed, verdict)``:

* ``case_save_full_disk``: the disk fills while one rank writes its file (rank 1, then rank 0,
  ...; 5 runs with ``full``); every rank must raise the same error naming that rank and file,
  leave no staging folder, keep ``latest``, and then train on and save again.
* ``case_one_sided``: ``save_checkpoint`` (stage 2) and ``load_checkpoint`` (stage 3) called on
  rank 0 while rank 1 trains on: rank 0's error names rank 1 and the collective it waits in,
  within ``TARGET_S``; rank 0 catches it and both ranks finish their training.
* ``case_user_timeout``: ``init_distributed(timeout=6 s)`` and a rank that stalls: the stall is
  named after 6 s, not the 300 s default.
* ``case_exit_mid_save``: rank 1 raises (uncaught), calls ``sys.exit(1)``, or is SIGKILLed while
  writing its file of a second tag, through ``zero run``: the job ends within ``TARGET_S`` of it,
  ``latest`` still names the first tag, which loads.
* ``case_swap_corruption``: random bytes written into an optimizer state's swap file (and, with
  ``full``, into a stage-3 parameter swap file) between steps: the next step fails naming the file.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
TINY = HERE / "tiny_train.py"
TARGET_S = 15.0
Row = tuple[str, str, str, str]


def _verdict(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def _engine(stage: int = 2, extra: dict | None = None) -> Any:
    import zero_core
    from zero_core.testing.models import TinyLM

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        **(extra or {}),
    }
    torch.manual_seed(0)
    engine, *_ = zero_core.initialize(model=TinyLM(16, 8, 12, mlp="one_layer", norm=False), config=cfg)
    return engine


def _train(engine: Any, steps: int, seed: int = 0) -> None:
    from zero_core import comm
    from zero_core.testing.models import token_batch

    for s in range(steps):
        x, y = token_batch(1000 * seed + 10 * s + comm.get_rank(), 2, 5, 16)
        engine.backward(engine(x, y))
        engine.step()


# -- a full disk on one rank, training goes on -------------------------------------------
def _full_disk_body(root: str, victim: int) -> dict:
    from zero_core import comm
    from zero_core.checkpoint import atomic

    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="good")
    _train(engine, 1, seed=1)
    real = atomic._write_all

    def full(f: Any, view: memoryview) -> None:
        if comm.get_rank() == victim and ".safetensors.tmp." in f.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
        real(f, view)

    atomic._write_all = full
    start = time.monotonic()
    try:
        engine.save_checkpoint(root, tag="next")
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        atomic._write_all = real
    took = time.monotonic() - start
    comm.barrier()
    staging = sorted(n for n in os.listdir(root) if n.startswith("."))
    latest = open(os.path.join(root, "latest")).read()
    _train(engine, 2, seed=2)  # training goes on after the caught error
    engine.save_checkpoint(root, tag="after")
    return {"error": error, "took": took, "staging": staging, "latest": latest, "after": engine.global_steps}


def case_save_full_disk(full: bool = False) -> list[Row]:
    """See the module docstring."""
    from zero_core.testing import run_multirank

    rows = []
    for i in range(5 if full else 1):
        victim = 1 - i % 2
        with tempfile.TemporaryDirectory() as root:
            start = time.monotonic()
            try:
                out = run_multirank(_full_disk_body, 2, args=(root, victim), timeout=240)
            except Exception as exc:
                rows.append(
                    (f"full disk on rank {victim} during a save (run {i + 1})", "-", f"{exc}"[:300], "FAIL")
                )
                continue
            final = open(os.path.join(root, "latest")).read()
        errors = {r["error"] for r in out}
        err = out[0]["error"]
        named = f"rank {victim}" in err and f"rank_{victim:05d}.safetensors" in err and "No space" in err
        ok = len(errors) == 1 and named and all(not r["staging"] and r["latest"] == "good" for r in out)
        ok = (
            ok
            and final == "after"
            and all(r["after"] == 4 for r in out)
            and max(r["took"] for r in out) < TARGET_S
        )
        observed = (
            f"{'same error on both ranks' if len(errors) == 1 else 'DIFFERENT errors'} after "
            f"{max(r['took'] for r in out):.1f} s: {err[:200]}; staging left: {out[0]['staging'] or 'none'}; latest "
            f"kept {out[0]['latest']!r}; trained on and saved 'after' (latest {final!r}) [{time.monotonic() - start:.0f} s]"
        )
        expected = (
            "one error on every rank naming the rank and file; no staging left; latest kept; training goes on"
        )
        rows.append(
            (f"full disk on rank {victim} during a save (run {i + 1})", expected, observed, _verdict(ok))
        )
    return rows


# -- save / load called on one rank while the other trains -------------------------------
def _one_sided_body(what: str, root: str) -> dict:
    from zero_core import comm

    stage = 3 if what == "load" else 2
    engine = _engine(stage)
    _train(engine, 1)
    engine.save_checkpoint(root, tag="t")
    error, took = "no error", 0.0
    if comm.get_rank() == 0:
        start = time.monotonic()
        try:
            if what == "save":
                engine.save_checkpoint(root, tag="alone")
            else:
                engine.load_checkpoint(root, tag="t")
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - start
    _train(engine, 2, seed=1)  # rank 1 went straight on; rank 0 after its caught error
    return {"error": error, "took": took, "steps": engine.global_steps}


def case_one_sided(full: bool = False) -> list[Row]:
    """See the module docstring."""
    from zero_core.testing import run_multirank

    rows = []
    for what in ("save", "load"):
        with tempfile.TemporaryDirectory() as root:
            start = time.monotonic()
            try:
                out = run_multirank(_one_sided_body, 2, args=(what, root), timeout=240)
            except Exception as exc:
                rows.append((f"one-sided {what}_checkpoint: rank 0 only", "-", f"{exc}"[:300], "FAIL"))
                continue
        err, took = out[0]["error"], out[0]["took"]
        call = f"{what}_checkpoint"
        named = f"rank(s) [1] did not call {call}" in err and "rank 1 waits in collective" in err
        ok = named and took < TARGET_S and all(r["steps"] == 3 for r in out)
        observed = f"after {took:.1f} s: {err[:230]}; both ranks trained on ({out[0]['steps']}, {out[1]['steps']} steps) [{time.monotonic() - start:.0f} s]"
        expected = f"rank 0's error names rank 1 and its collective within {TARGET_S:g} s; training goes on"
        rows.append(
            (
                f"one-sided {call}: rank 0 only (stage {3 if what == 'load' else 2}), rank 1 trains",
                expected,
                observed,
                _verdict(ok),
            )
        )
    return rows


# -- processes through zero run ----------------------------------------------------------
def _zero_run(args: list[str], timeout: float = 300.0) -> tuple[int | str, str, float]:
    cmd = [
        sys.executable,
        "-c",
        "import sys; from zero_core.launcher.cli import main; sys.exit(main())",
        "run",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.time()
    except subprocess.TimeoutExpired as exc:
        return "hung", str(exc.stdout or "") + str(exc.stderr or ""), time.time()


def case_user_timeout(full: bool = False) -> list[Row]:
    """See the module docstring."""
    start = time.time()
    rc, out, end = _zero_run(
        ["--nproc", "2", str(TINY), "--stage", "2", "--fault", "stall", "--init-timeout", "6"]
    )
    line = next((ln for ln in out.splitlines() if "CollectiveTimeoutError" in ln and "rank 0" in ln), "")
    named = "rank 1" in line and "timeout 6 s" in line
    ok = named and rc not in (0, "hung") and end - start < 120
    head = line.split("CollectiveTimeoutError: ")[-1][:230] if line else "(no timeout error)"
    observed = f"{head}; job status {rc} after {end - start:.0f} s (incl. start-up)"
    return [
        (
            "init_distributed(timeout=6 s), rank 1 stalls",
            "stall named after 6 s, not 300 s",
            observed,
            _verdict(ok),
        )
    ]


def case_exit_mid_save(full: bool = False) -> list[Row]:
    """See the module docstring."""
    from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    rows = []
    for kind in ("raise", "exit", "sigkill") if full else ("raise", "exit"):
        with tempfile.TemporaryDirectory() as root:
            rc, out, end = _zero_run(
                [
                    "--nproc",
                    "2",
                    str(TINY),
                    "--stage",
                    "2",
                    "--save-dir",
                    root,
                    "--save-fault",
                    kind,
                    "--steps",
                    "1",
                ]
            )
            fault = re.search(r"^FAULT ([0-9.]+)", out, re.M)
            after = end - float(fault.group(1)) if fault else None
            latest = (
                open(os.path.join(root, "latest")).read()
                if os.path.exists(os.path.join(root, "latest"))
                else None
            )
            try:
                loads = bool(get_fp32_state_dict_from_zero_checkpoint(root))
            except Exception as exc:
                loads = f"load failed: {exc}"[:100]
            partial = os.path.isdir(os.path.join(root, "t2"))
        ok = fault is not None and after <= TARGET_S and rc not in (0, "hung") and latest == "t1"
        ok = ok and loads is True and not partial
        when = f"{after:.1f} s" if after is not None else "no FAULT line"
        observed = f"job ended {when} after the fault (status {rc}); latest {latest!r}, loads: {loads}; tag t2 {'EXISTS' if partial else 'absent'}"
        rows.append(
            (
                f"{kind} on rank 1 while it writes a save",
                "job ends fast; previous tag is latest and loads",
                observed,
                _verdict(ok),
            )
        )
    return rows


# -- corrupted swap files -------------------------------------------------------------------
def _swap_body(nvme: str, target: str) -> str:
    extra: dict[str, Any] = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}
    }
    if target == "param":
        extra = {
            "zero_optimization": {
                "stage": 3,
                # two read-ahead buffers: shards beyond them are read from the file in the next step
                "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0, "buffer_count": 2},
                "stage3_param_persistence_threshold": 0,
            }
        }
    engine = _engine(extra["zero_optimization"]["stage"], {"zero_optimization": extra["zero_optimization"]})
    _train(engine, 1)
    files = sorted(
        p
        for p in Path(nvme).rglob("*.swp")
        if p.stat().st_size and ("param" in p.name) == (target == "param")
    )
    victim = files[0]
    with open(victim, "r+b") as f:  # random bytes over the whole file (a shard read ahead already escapes)
        f.write(os.urandom(victim.stat().st_size))
    try:
        _train(engine, 1, seed=1)
        return f"no error after corrupting {victim.name}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc} (corrupted: {victim.name})"
    finally:
        engine.destroy()


def case_swap_corruption(full: bool = False) -> list[Row]:
    """See the module docstring."""
    from zero_core.testing import run_multirank

    rows = []
    for target in ("optimizer state", "param") if full else ("optimizer state",):
        with tempfile.TemporaryDirectory() as nvme:
            out = run_multirank(_swap_body, 1, args=(nvme, target), timeout=240)[0]
        name = out.rsplit("(corrupted: ", 1)[-1].rstrip(")")
        ok = out.startswith("SwapFileError") and f"{name}: bytes [" in out
        rows.append(
            (
                f"random bytes in a swap file ({target})",
                "the next read fails naming the file",
                out[:260],
                _verdict(ok),
            )
        )
    return rows


CASES = [case_save_full_disk, case_one_sided, case_user_timeout, case_exit_mid_save, case_swap_corruption]
