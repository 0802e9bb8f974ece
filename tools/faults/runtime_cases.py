"""Runtime fault-injection cases (issue 25): mismatched ranks, stalled ranks, exits, SIGTERM.

Each case function takes ``full`` (the by-hand size) and returns a list of rows
``(case, expected, observed, verdict)`` with verdict ``"ok"`` or ``"FAIL"``. ``run_faults.py``
prints them as a table; ``tests/test_faults_runtime.py`` (the in-process cases) and
``tests/test_faults_runtime_processes.py`` (``PROCESS_CASES``) assert every verdict is ``ok``.
Multi-rank cases use ``zero_core.testing.run_multirank`` (forked gloo ranks); the exit and
SIGTERM cases start real processes (``zero run``, a plain ``python``), because what they check
happens at interpreter exit or on a signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
TINY = HERE / "tiny_train.py"
TIMEOUT_S = 8.0  # the collective timeout the cases run with (comms_timeout)
Row = tuple[str, str, str, str]


def _verdict(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def _engine(stage: int = 2, odd: str = "", save_dir: str = "", tag_validation: str = "Warn") -> Any:
    """A tiny engine; on rank 1 the setup differs by ``odd`` (stage/micro/gas/precision/model)."""
    import zero_core
    from zero_core import comm
    from zero_core.testing.models import TinyLM

    differs = comm.get_rank() == 1
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 3 if (differs and odd == "micro") else 2,
        "steps_per_print": 10**6,
        "comms_timeout": TIMEOUT_S,
        "zero_optimization": {"stage": 3 if (differs and odd == "stage") else stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "checkpoint": {"tag_validation": tag_validation},
    }
    if differs and odd == "gas":
        cfg["gradient_accumulation_steps"] = 2
    if differs and odd == "precision":
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    model = TinyLM(16, 8, 16 if (differs and odd == "model") else 12, mlp="one_layer", norm=False)
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    return engine


def _train_step(engine: Any, step: int) -> None:
    from zero_core import comm
    from zero_core.testing.models import token_batch

    x, y = token_batch(100 * step + comm.get_rank(), 2, 5, 16)
    engine.backward(engine(x, y))
    engine.step()


def _mismatch_body(odd: str) -> str:
    engine = _engine(odd=odd)
    _train_step(engine, 0)
    return "trained"


def _multirank(fn: Any, *args: Any) -> tuple[str, float]:
    """Run ``fn`` on 2 ranks; ``(error text or results, seconds)``."""
    from zero_core.testing import run_multirank

    start = time.monotonic()
    try:
        out = run_multirank(fn, 2, args=args, timeout=240)
        return f"no error: {out}", time.monotonic() - start
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


def _line(text: str, marker: str, width: int = 230) -> str:
    """The first line of ``text`` containing ``marker`` (the error's own message), shortened."""
    for line in text.splitlines():
        if marker in line:
            return line.strip()[:width]
    return text.strip().splitlines()[0][:width] if text.strip() else "(nothing)"


MISMATCHES = {
    "stage": "zero_optimization.stage",
    "micro": "train_micro_batch_size_per_gpu",
    "gas": "gradient_accumulation_steps",
    "precision": "precision",
    "model": "model parameters",
}


def case_mismatches(full: bool = False) -> list[Row]:
    """One rank's setup differs: initialize names the field and the ranks, within the timeout."""
    rows = []
    for odd, field in MISMATCHES.items():
        text, took = _multirank(_mismatch_body, odd)
        msg = _line(text, "RankMismatchError: initialize")
        ok = f"ranks disagree on {field}" in msg and "rank 1" in msg and "rank 0" in msg and took < 120
        rows.append(
            (
                f"mismatch: {odd} differs on rank 1",
                f"RankMismatchError naming {field}",
                f"{msg} [{took:.0f} s]",
                _verdict(ok),
            )
        )
    return rows


def _save_body(mode: str, save_dir: str) -> dict:
    import warnings

    from zero_core import comm

    engine = _engine(save_dir=save_dir, tag_validation="Warn" if mode == "alone" else mode)
    _train_step(engine, 0)
    rank = comm.get_rank()
    if mode == "alone":
        if rank == 0:
            engine.save_checkpoint(save_dir, tag="t1")
        return {"saved": sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_checkpoint(save_dir, tag="other" if rank == 1 else "t1")
    return {
        "saved": sorted(n for n in os.listdir(save_dir) if not n.startswith(".")),
        "warnings": [str(w.message) for w in caught if "different tags" in str(w.message)],
    }


def case_save_checkpoint(full: bool = False) -> list[Row]:
    """save_checkpoint on one rank only, and different tags under tag_validation Warn/Fail/Ignore."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text, took = _multirank(_save_body, "alone", os.path.join(tmp, "alone"))
        msg = _line(text, "RankMismatchError: save_checkpoint")
        ok = "rank(s) [1] did not call save_checkpoint" in msg and took < TIMEOUT_S + 120
        rows.append(
            (
                "save_checkpoint on rank 0 only",
                "error naming rank 1 within the timeout",
                f"{msg} [{took:.0f} s]",
                _verdict(ok),
            )
        )
        for mode in ("Warn", "Fail", "Ignore"):
            text, took = _multirank(_save_body, mode, os.path.join(tmp, mode))
            if mode == "Fail":
                msg = _line(text, "TagMismatchError: save_checkpoint")
                ok = "ranks passed different tags" in msg and "'other'" not in msg and "other" in msg
                expected = "TagMismatchError naming both tags"
            else:
                msg = text[:230]
                want_warn = mode == "Warn"
                ok = text.startswith("no error") and "'saved': ['latest', 't1'" in text
                ok = ok and (("rank 0's tag 't1'" in text) == want_warn)
                expected = (
                    "a warning naming the tags; " if want_warn else "no warning; "
                ) + "saved under rank 0's tag"
            rows.append(
                (f"different tags, tag_validation {mode}", expected, f"{msg} [{took:.0f} s]", _verdict(ok))
            )
    return rows


def _stall_body(stage: int) -> str:
    from zero_core import comm

    engine = _engine(stage=stage)
    if comm.get_rank() == 1:
        time.sleep(3600)  # stuck (a data loader, a dead file system): its peer waits in a collective
    _train_step(engine, 0)
    return "trained"


def case_stalls(full: bool = False) -> list[Row]:
    """A rank stalls before backward at stages 2 and 3: the peer names the collective and rank 1
    within the timeout, and every process exits (no RankTimeoutError of the harness)."""
    rows = []
    for stage in (2, 3):
        text, took = _multirank(_stall_body, stage)
        full_msg = _line(text, "CollectiveTimeoutError: rank 0", width=10**6)
        named = "did not arrive: rank 1" in full_msg and "collective " in full_msg
        exited = "RankFailedError: 2 of 2 ranks failed" in text
        ok = named and exited and took < TIMEOUT_S + 120
        head = full_msg.split(" did not complete")[0].split("CollectiveTimeoutError: ")[-1]
        culprit = full_msg.split("Rank(s) that did not arrive: ")[-1][:110] if named else "(no rank named)"
        observed = f"{head}; did not arrive: {culprit} | {'all ranks exited' if exited else 'NOT all exited'} [{took:.0f} s]"
        rows.append(
            (
                f"stall: rank 1 sleeps at stage {stage}",
                "error naming the collective and rank 1; all exit",
                observed,
                _verdict(ok),
            )
        )
    return rows


def _object_stall_body() -> str:
    from zero_core import comm

    comm.watchdog.set_collective_timeout(TIMEOUT_S / 2)
    comm.barrier()  # starts the watchdog; both ranks have records
    if comm.get_rank() == 1:
        time.sleep(3600)
    gathered: list = [None, None]
    comm.all_gather_object(gathered, {"rank": comm.get_rank()})  # not waitable: the thread's case
    return "gathered"


def case_stall_unwaitable(full: bool = False) -> list[Row]:
    """A collective the waiting thread cannot bound itself (an object collective; NCCL ops are
    alike): the watchdog's thread diagnoses it at the timeout and ends both processes."""
    text, took = _multirank(_object_stall_body)
    limit = TIMEOUT_S / 2 + max(2.0, 0.1 * TIMEOUT_S / 2) + 60
    msg = _line(text, "CollectiveTimeoutError: rank 0", width=10**6)
    named = "did not arrive: rank 1" in msg and "all_gather_object" in msg
    exited = "RankFailedError: 2 of 2 ranks failed" in text and "rank 1 exited with exit code 1" in text
    ok = named and exited and took < limit
    head = msg.split(" did not complete")[0].split("CollectiveTimeoutError: ")[-1]
    observed = (
        f"{head}; rank 1 named: {named}; {'both exited' if exited else 'NOT both exited'} [{took:.0f} s]"
    )
    return [
        (
            "stall: all_gather_object, rank 1 sleeps",
            "error naming the collective and rank 1; all exit",
            observed,
            _verdict(ok),
        )
    ]


def case_stall_real_exit(full: bool = False) -> list[Row]:
    """Through ``zero run`` (real interpreter exit): a stage-3 stall ends the job with the error
    naming the collective and rank 1, instead of hanging at exit until the group's 30-minute timeout."""
    start = time.monotonic()
    cmd = [
        *_zero_cli(),
        "run",
        "--nproc",
        "2",
        str(TINY),
        "--stage",
        "3",
        "--fault",
        "stall",
        "--comms-timeout",
        "5",
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=400
        )
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = str(exc.stdout or "") + str(exc.stderr or ""), "hung"
    took = time.monotonic() - start
    msg = _line(out, "CollectiveTimeoutError: rank 0", width=10**6)
    named = "did not arrive: rank 1" in msg
    ok = named and rc not in (0, "hung")
    head = msg.split(" did not complete")[0].split("CollectiveTimeoutError: ")[-1]
    observed = f"{head}; rank 1 named: {named}; job status {rc} after {took:.0f} s (incl. start-up)"
    return [
        (
            "stall: zero run, stage 3, real exit",
            "error naming rank 1, then the job ends",
            observed,
            _verdict(ok),
        )
    ]


def _python() -> str:
    return sys.executable


def _zero_cli() -> list[str]:
    return [_python(), "-c", "import sys; from zero_core.launcher.cli import main; sys.exit(main())"]


def case_clean_exit(full: bool = False) -> list[Row]:
    """Successful 4-rank runs at stages 0-3 through ``zero run`` end with status 0, never SIGABRT.

    ``full``: 20 runs (5 per stage); otherwise 2 (stages 1 and 3, where the abort was seen).
    """
    stages = [0, 1, 2, 3] * 5 if full else [1, 3]
    results: dict[int, list[str]] = {s: [] for s in sorted(set(stages))}
    evidence: list[str] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for stage in stages:
        proc = subprocess.run(
            [*_zero_cli(), "run", "--nproc", "4", str(TINY), "--stage", str(stage), "--steps", "2"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        out = proc.stdout + proc.stderr
        aborted = "terminate called" in out or "SIGABRT" in out or "Signals.SIGABRT" in out
        results[stage].append(
            "abort" if aborted else ("ok" if proc.returncode == 0 else f"rc {proc.returncode}")
        )
        if aborted or proc.returncode:
            marker = "terminate called" if aborted else "Error"
            evidence.append(f"stage {stage}: rc {proc.returncode}: " + _line(out, marker, 160))
    rows = []
    for stage, outcomes in results.items():
        good = outcomes.count("ok")
        rows.append(
            (
                f"exit: {len(outcomes)} x zero run --nproc 4, stage {stage}",
                "every run exits 0, no SIGABRT",
                f"{good} ok, {outcomes.count('abort')} aborts, others {[o for o in outcomes if o not in ('ok', 'abort')]}"
                + "".join(f"; {e}" for e in evidence if e.startswith(f"stage {stage}:")),
                _verdict(good == len(outcomes)),
            )
        )
    return rows


def case_sigterm_nvme(full: bool = False) -> list[Row]:
    """SIGTERM during training with NVMe optimizer offload: no swap file is left behind and the
    process ends as killed by SIGTERM."""
    with tempfile.TemporaryDirectory() as nvme:
        env = dict(os.environ, OMP_NUM_THREADS="1", ZERO_JOB_NAME="sigterm-case")
        proc = subprocess.Popen(
            [_python(), str(TINY), "--stage", "2", "--fault", "sigterm", "--nvme", nvme],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        seen_files = False
        deadline = time.monotonic() + 300
        assert proc.stdout is not None
        for line in proc.stdout:
            if "TRAINING" in line:
                seen_files = any(f.is_file() for f in Path(nvme).rglob("*"))
                break
            if time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        left = sorted(str(p.relative_to(nvme)) for p in Path(nvme).rglob("*"))
    ok = seen_files and not left and rc == -signal.SIGTERM
    observed = f"swap files while training: {seen_files}; left after SIGTERM: {left or 'none'}; status {rc}"
    return [
        (
            "SIGTERM mid-training, NVMe offload",
            "no swap files left; killed by SIGTERM (-15)",
            observed,
            _verdict(ok),
        )
    ]


CASES = [
    case_mismatches,
    case_save_checkpoint,
    case_stalls,
    case_stall_unwaitable,
    case_stall_real_exit,
    case_clean_exit,
    case_sigterm_nvme,
]
#: the cases that start real interpreters (``zero run``, ``python``): most of the CI time of
#: ``CASES``, tested in a file of their own so that pytest-xdist's ``--dist loadfile`` can run
#: them beside the in-process ones instead of one worker carrying both
PROCESS_CASES = [case_stall_real_exit, case_clean_exit, case_sigterm_nvme]


def assert_ok(case: Any) -> None:
    """Run ``case`` in its small (CI) size; AssertionError listing each row not ``ok``."""
    rows = case(full=False)
    assert rows, f"{case.__name__} produced no rows"
    failed = [r for r in rows if r[3] != "ok"]
    assert not failed, "\n".join(f"{c}: expected {e}; observed {o}" for c, e, o, _ in failed)
