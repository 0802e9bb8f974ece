"""Single-process units of issue 37's fail-fast machinery: failure records in a store (and which
one is named), where a traceback was, a waiting rank leaving its collective once a member failed
(and never slicing a point-to-point wait), the timeout order with ``init_distributed``'s, a peer
waiting on a rank that is elsewhere, ``zero run``'s exit status and summary, the shim's one-line
report of a follower's error, and a save outcome in a single process. The multi-rank and real
process behaviour is in tests/test_faults_rank_failure.py and tools/faults."""

from __future__ import annotations

import json
import signal
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from zero_core.comm import failures, peer_state, watchdog
from zero_core.comm.failures import FailureRecord
from zero_core.launcher import rank_errors
from zero_core.launcher.run import failed_first, failure_summary


@pytest.fixture
def store(monkeypatch):
    s = dist.HashStore()
    monkeypatch.setattr(failures, "default_store", lambda: s)
    monkeypatch.setattr(failures, "_STATE", failures._State())
    return s


def test_failure_record_written_once_first_key_kept(store, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    rec = failures.record("RuntimeError: boom", "in backward at train.py:9", code=3)
    assert failures.this_process_failed() == rec and rec.rank == 1 and rec.code == 3
    assert failures.record("later") is rec  # the first call wins
    assert failures.read_first(store) == rec
    # a second process's record does not replace the first one
    other = FailureRecord(rank=0, error="PeerFailedError: x", cause=1, time=rec.time + 1)
    store.set(f"{failures.PREFIX}/0", other.to_json())
    store.compare_set(failures.FIRST_KEY, "", other.to_json())
    assert failures.read_first(store).rank == 1
    assert failures.read_ranks(store, [0, 1, 2]) == {0: other, 1: rec}
    assert rec.describe() == "rank 1 failed in backward at train.py:9: RuntimeError: boom"
    assert other.describe() == "rank 0 stopped because rank 1 failed: PeerFailedError: x"


def test_root_failure_prefers_a_rank_that_failed_on_its_own():
    follower = FailureRecord(rank=0, error="e", cause=2, time=1.0)
    root = FailureRecord(rank=2, error="e", time=2.0)
    assert failures.root_failure([follower, root]) == root
    assert failures.root_failure([follower]) == follower
    assert failures.root_failure([]) is None
    assert FailureRecord.from_json("not json") is None


def test_where_names_engine_phase_collective_and_user_line():
    ns: dict = {}
    # stand-ins for the engine's backward and a collective, by file and function name
    exec(compile("def backward(f):\n    f()\n", "/x/zero_core/engine/engine.py", "exec"), ns)
    exec(
        compile(
            "def all_reduce():\n    raise RuntimeError('x')\n", "/x/zero_core/comm/collectives.py", "exec"
        ),
        ns,
    )
    try:
        ns["backward"](ns["all_reduce"])  # the user's line
    except RuntimeError as exc:
        where = failures.where_of(exc.__traceback__)
    line = where.rsplit(":", 1)[-1]
    assert where == f"in backward in all_reduce at test_failfast_units.py:{line}" and line.isdigit(), where


def test_record_exception_names_the_rank_a_follower_followed(store):
    exc = watchdog.PeerFailedError("rank 0: collective x cannot complete: rank 3 failed", 3)
    rec = failures.record_exception(exc)
    assert rec.cause == 3 and rec.error.startswith("PeerFailedError: rank 0")


class _SlowWork:
    """A collective Work that never completes; a timed wait times out after its timeout."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        time.sleep(timeout.total_seconds())
        raise RuntimeError("Operation timed out!")

    def is_completed(self):
        return False


def test_waiting_rank_leaves_once_a_member_failed(monkeypatch):
    monkeypatch.setattr(watchdog.dist, "get_backend", lambda group=None: "gloo")
    wd = watchdog.CollectiveWatchdog(4.0, rank=0)  # polls of 0.2 s
    token = wd.begin("all_reduce", (0, 1))
    wd.failures = {1: FailureRecord(rank=1, error="RuntimeError: user bug", where="in forward at t.py:3")}
    work = _SlowWork()
    start = time.monotonic()
    with pytest.raises(watchdog.PeerFailedError) as info:
        wd.wait(work, token)
    assert time.monotonic() - start < 1.0 and work.waits == 1
    assert info.value.failed_rank == 1
    assert str(info.value) == (
        "rank 0: collective all_reduce (#1 on the group of global ranks [0, 1]) cannot complete: "
        "rank 1 failed in forward at t.py:3: RuntimeError: user bug."
    )
    assert wd.fired is None  # a failed peer is not a hang: no abort record for the others


def test_a_failed_rank_outside_the_group_does_not_end_the_wait(monkeypatch):
    monkeypatch.setattr(watchdog.dist, "get_backend", lambda group=None: "gloo")
    wd = watchdog.CollectiveWatchdog(1.0, rank=0)
    token = wd.begin("all_reduce", (0, 1))
    wd.failures = {2: FailureRecord(rank=2, error="e")}
    with pytest.raises(watchdog.CollectiveTimeoutError) as info:
        wd.wait(_SlowWork(), token)
    assert not isinstance(info.value, watchdog.PeerFailedError)
    assert "did not complete: waited" in str(info.value)


def test_point_to_point_waits_are_never_sliced(monkeypatch):
    """A timed-out gloo recv breaks its connection: such waits get the whole deadline at once."""
    from zero_core.comm.gloo_direct import DirectWork

    monkeypatch.setattr(watchdog.dist, "get_backend", lambda group=None: "gloo")
    wd = watchdog.CollectiveWatchdog(30.0, rank=0)
    seen = []

    class Recv:
        def wait(self, timeout=None):
            seen.append(timeout)
            return True

    wd.wait(Recv(), wd.begin("irecv", (0, 1)))
    direct = DirectWork([Recv()], None)
    wd.wait(direct, wd.begin("reduce_scatter_tensor", (0, 1)))
    assert all(t > timedelta(seconds=29) for t in seen), seen
    assert not watchdog._resumable(direct, None) and watchdog._resumable(object(), None)


def test_init_distributed_timeout_bounds_collectives_below_config_and_env(monkeypatch):
    monkeypatch.setattr(watchdog, "_SLOT", watchdog._WatchdogSlot())
    monkeypatch.delenv("ZERO_STAGE3_COLLECTIVE_TIMEOUT", raising=False)
    monkeypatch.delenv(watchdog.ENV_TIMEOUT, raising=False)
    watchdog.set_init_timeout(45)
    assert watchdog.collective_timeout() == 45.0  # the user's timeout wins over the 300 s default
    monkeypatch.setenv(watchdog.ENV_TIMEOUT, "20")
    assert watchdog.collective_timeout() == 20.0  # the environment keeps its place
    watchdog.set_collective_timeout(10)  # as the config's comms_timeout
    assert watchdog.collective_timeout() == 10.0
    with pytest.raises(ValueError, match="init_distributed"):
        watchdog.set_init_timeout(0)


def test_peer_waiting_on_this_rank_is_found(monkeypatch):
    store = dist.HashStore()
    rec = {"seq": {"0,1": 7}, "op": "reduce_scatter_tensor", "wait": ["0,1", 7, "reduce_scatter_tensor"]}
    store.set("zero_watchdog/1", json.dumps(rec))
    store.set("zero_watchdog/2", json.dumps({"seq": {}, "wait": ["1,2", 3, "all_reduce"]}))
    assert peer_state.waiting_on(store, 0, {"0,1": 6}, [1, 2]) == [(1, "reduce_scatter_tensor", 7, [0, 1])]
    assert peer_state.waiting_on(store, 0, {"0,1": 7}, [1, 2]) == []  # it waits in one this rank issued
    from zero_core.distributed.teardown import _left_mid_job

    why = _left_mid_job(store, 0, {"0,1": 6}, [1, 2])
    assert "rank 1 waits in collective reduce_scatter_tensor (#7" in why and "rank 0 issued 6" in why


def _failure(code: int, timestamp: int = 100) -> SimpleNamespace:
    return SimpleNamespace(exitcode=code, timestamp=timestamp)


def test_zero_run_exits_with_the_status_of_the_rank_that_failed_first():
    # rank 1 raised (its note), rank 0 only followed it
    notes = {
        1: {"code": 1, "followed": False, "time": 100.5},
        0: {"code": 1, "followed": True, "time": 100.9},
    }
    fails = {0: _failure(1), 1: _failure(1)}
    assert failed_first(fails, notes) == (1, 1)
    assert (
        failure_summary("t.py", fails, notes)
        == "t.py failed on rank 1 (exit code 1); rank 0 stopped because of it"
    )
    # sys.exit(3) on rank 1: zero run exits 3
    assert (
        failed_first(
            {0: _failure(1), 1: _failure(3)},
            {1: {"code": 3, "time": 1.0}, 0: {"followed": True, "time": 2.0}},
        )[1]
        == 3
    )
    # rank 1 ended by a SIGTERM of its own, rank 0 by torchrun's right after (same second): the
    # order in which torchrun saw them end decides
    fails = {1: _failure(-signal.SIGTERM), 0: _failure(-signal.SIGTERM)}
    assert failed_first(fails, {}) == (1, 143)
    # rank 2 SIGKILLed (no note), the others stopped by torchrun's SIGTERM: 128 + 9
    fails = {0: _failure(-signal.SIGTERM), 1: _failure(-signal.SIGTERM), 2: _failure(-signal.SIGKILL)}
    assert failed_first(fails, {}) == (2, 137)
    assert (
        failure_summary("t.py", fails)
        == "t.py failed on rank 2 (killed by SIGKILL); ranks 0, 1 stopped by the launcher"
    )


def test_shim_reports_a_follower_in_one_line_and_notes_it(tmp_path, monkeypatch, capsys, store):
    monkeypatch.setenv(rank_errors.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")

    def follower():
        raise watchdog.PeerFailedError(
            "rank 0: collective all_reduce (#3 ...) cannot complete: rank 1 failed: boom", 1
        )

    with pytest.raises(SystemExit) as info:
        rank_errors.run_reporting_once(follower)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "[rank 0] PeerFailedError: rank 0: collective all_reduce (#3 ...) cannot complete: rank 1 failed: boom"
    )
    assert rank_errors.read_exit_notes(tmp_path)[0]["followed"] is True
    assert failures.this_process_failed().cause == 1


def test_shim_keeps_sys_exit_status_and_records_it(tmp_path, monkeypatch, store):
    monkeypatch.setenv(rank_errors.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as info:
        rank_errors.run_reporting_once(lambda: sys.exit(3))
    assert info.value.code == 3
    assert rank_errors.read_exit_notes(tmp_path)[1]["code"] == 3
    rec = failures.read_first(store)
    assert rec.rank == 1 and rec.code == 3 and rec.error == "sys.exit(3)"


def test_save_outcome_in_one_process_raises_the_error_itself():
    from zero_core.checkpoint import outcome

    err = OSError(28, "No space left on device")
    with pytest.raises(OSError) as info:
        outcome.agree(None, err, "save_checkpoint of tag 't'")
    assert info.value is err
    outcome.agree(None, None, "save_checkpoint of tag 't'")  # nothing failed: nothing raised
    assert outcome.attempt(lambda: 1) is None and isinstance(
        outcome.attempt(lambda: 1 / 0), ZeroDivisionError
    )
