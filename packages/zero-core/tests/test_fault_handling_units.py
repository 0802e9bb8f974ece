"""Single-process units of issue 25's fault handling: the SIGTERM cleanup chain (callbacks run,
then the previous handler or the default action), the collective timeout's sources and errors,
and the engine's agreement digest naming the first field that differs."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from zero_core.comm import watchdog
from zero_core.engine.agreement import _describe


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_sigterm_runs_callbacks_then_the_default_action(tmp_path):
    marker = tmp_path / "cleaned"
    proc = _run(f"""
        import os, signal, time
        from zero_core.utils.termination import on_termination
        on_termination(lambda: open({str(marker)!r}, "w").write("x"))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("survived")
    """)
    assert marker.exists()
    assert proc.returncode == -signal.SIGTERM and "survived" not in proc.stdout


def test_sigterm_chains_to_the_previous_handler(tmp_path):
    proc = _run("""
        import os, signal, sys
        def mine(signum, frame):
            print("previous handler ran", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, mine)
        from zero_core.utils.termination import forget, on_termination
        on_termination(lambda: print("cleanup ran", flush=True))
        gone = on_termination(lambda: print("forgotten ran", flush=True))
        forget(gone)
        os.kill(os.getpid(), signal.SIGTERM)
    """)
    assert proc.stdout.splitlines() == ["cleanup ran", "previous handler ran"]
    assert proc.returncode == 7


def test_collective_timeout_sources_and_errors(monkeypatch):
    monkeypatch.setattr(watchdog, "_SLOT", watchdog._WatchdogSlot())
    monkeypatch.delenv("ZERO_STAGE3_COLLECTIVE_TIMEOUT", raising=False)
    monkeypatch.delenv(watchdog.ENV_TIMEOUT, raising=False)
    assert watchdog.collective_timeout() == 300.0  # minutes, not the process group's half hour
    monkeypatch.setenv(watchdog.ENV_TIMEOUT, "42")
    assert watchdog.collective_timeout() == 42.0
    watchdog.set_collective_timeout(7)
    assert watchdog.collective_timeout() == 7.0
    for bad in (0, -1, True, "5"):
        with pytest.raises(ValueError, match="positive number of seconds"):
            watchdog.set_collective_timeout(bad)
    monkeypatch.setattr(watchdog._SLOT, "pending_timeout", None)
    monkeypatch.setenv(watchdog.ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="ZERO_COLLECTIVE_TIMEOUT must be a positive number of seconds"):
        watchdog.collective_timeout()


def test_comms_timeout_config_key_is_validated():
    from zero_core.config import load_config

    assert load_config({"train_batch_size": 1, "comms_timeout": 30}, world_size=1).comms_timeout == 30.0
    with pytest.raises(Exception, match="comms_timeout"):
        load_config({"train_batch_size": 1, "comms_timeout": 0}, world_size=1)


def test_mismatch_description_names_first_difference():
    ranks = (0, 1, 2)
    assert _describe([2, 2, 3], ranks) == "ranks 0, 1: 2; rank 2: 3"
    params = [["a [2] float32", "b [3] float32"], ["a [2] float32", "b [4] float32"], ["a [2] float32"]]
    assert _describe(params, ranks).startswith(
        "entry 1: rank 0: b [3] float32; rank 1: b [4] float32; rank 2: (none)"
    )
    cfgs = [{"x": 1, "y": 2}, {"x": 1, "y": 3}, {"x": 1, "y": 2}]
    assert _describe(cfgs, ranks) == "key 'y': ranks 0, 2: 2; rank 1: 3"
