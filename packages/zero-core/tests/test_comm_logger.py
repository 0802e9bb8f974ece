"""comms_logger: counts, bytes and time per op and per group; async timing; config; summary."""

from __future__ import annotations

import time

import pytest
import torch
from zero_core import comm
from zero_core.comm import CommsLogger, Stats, comms_logger
from zero_core.comm.logger import PendingRecord, bus_bandwidth_factor
from zero_core.testing import multirank


@multirank(world_sizes=(2,))
def test_counts_and_bytes_per_op_and_group():
    rank = comm.get_rank()
    comms_logger.reset()
    comms_logger.enable()
    try:
        psi = 1000  # elements of a flat fp32 "model"
        grads = torch.ones(psi)
        shard = torch.empty(psi // 2)
        comm.reduce_scatter_tensor(shard, grads)
        full = torch.empty(psi)
        comm.all_gather_into_tensor(full, shard)
        for _ in range(3):
            comm.all_reduce(torch.ones(10, dtype=torch.bfloat16))
        solo = [comm.new_group([r]) for r in range(2)]
        comm.all_reduce(torch.ones(7), group=solo[rank])
        comm.all_gather([torch.empty(r + 1) for r in range(2)], torch.ones(rank + 1))  # uneven: logical bytes
        comm.barrier()
        comm.all_gather_object([None, None], rank)
    finally:
        comms_logger.disable()
    world = (0, 1)
    s = comms_logger.summary()
    assert s[("reduce_scatter_tensor", world)].count == 1
    assert comms_logger.bytes_for("reduce_scatter_tensor") == 4 * psi  # the full input
    assert comms_logger.bytes_for("all_gather_into_tensor") == 4 * psi  # the full output
    assert s[("all_reduce", world)] == Stats(3, 3 * 10 * 2, s[("all_reduce", world)].total_time_s)
    assert s[("all_reduce", (rank,))].count == 1 and s[("all_reduce", (rank,))].bytes == 28
    assert comms_logger.count_for("all_reduce") == 4 and comms_logger.count_for("all_reduce", world) == 3
    assert comms_logger.bytes_for("all_gather") == 4 * 3
    assert s[("barrier", world)].bytes == 0 and s[("all_gather_object", world)].count == 1
    assert all(st.total_time_s > 0 for st in s.values())
    # disabled: nothing more is recorded
    comm.all_reduce(torch.ones(10))
    assert comms_logger.count_for("all_reduce") == 4
    comms_logger.reset()
    assert comms_logger.summary() == {}


@multirank(world_sizes=(2,))
def test_prof_ops_filter_and_async_timing():
    comms_logger.reset()
    comms_logger.enable(prof_ops=["all_reduce", "isend", "irecv", "batch_isend_irecv"])
    try:
        comm.broadcast(torch.ones(4), 0)  # not profiled
        t = torch.ones(256)
        w = comm.all_reduce(t, async_op=True)
        assert comms_logger.count_for("all_reduce") == 1  # counted at issue
        assert comms_logger.summary()[("all_reduce", (0, 1))].total_time_s == 0.0  # timed at wait
        time.sleep(0.05)
        w.wait()
        w.wait()  # a second wait adds nothing
        peer = 1 - comm.get_rank()
        ops = [comm.P2POp(comm.isend, torch.ones(8), peer), comm.P2POp(comm.irecv, torch.empty(8), peer)]
        works = comm.batch_isend_irecv(ops)
        works[0].wait()
        assert comms_logger.summary()[("batch_isend_irecv", (0, 1))].total_time_s == 0.0  # one handle left
        works[1].wait()
    finally:
        comms_logger.disable()
    s = comms_logger.summary()
    assert comms_logger.count_for("broadcast") == 0
    assert s[("all_reduce", (0, 1))].total_time_s >= 0.05  # issue -> wait, including the sleep
    assert s[("batch_isend_irecv", (0, 1))].bytes == 64 and s[("batch_isend_irecv", (0, 1))].total_time_s > 0
    comms_logger.reset()


def test_configure_from_config_section():
    log = CommsLogger()
    log.configure(
        {"enabled": True, "verbose": False, "prof_all": False, "prof_ops": ["all_reduce"], "debug": False}
    )
    assert log.enabled and log.should_log("all_reduce") and not log.should_log("broadcast")
    log.configure({"enabled": True})
    assert log.prof_all and log.should_log("broadcast")

    class Section:  # pydantic-model-like object
        enabled = False
        prof_all = True

    log.configure(Section())
    assert not log.enabled and not log.should_log("all_reduce")
    with pytest.raises(ValueError, match="unknown key\\(s\\) \\['prof_al'\\]"):
        log.configure({"prof_al": True})
    with pytest.raises(ValueError, match="unknown op 'allreduce'"):
        log.configure({"prof_ops": ["allreduce"]})
    with pytest.raises(TypeError, match="'verbose' must be a bool"):
        log.configure({"verbose": "yes"})
    with pytest.raises(TypeError, match="list of op names"):
        log.enable(prof_ops="all_reduce")


def test_verbose_debug_and_log_summary():
    log = CommsLogger()
    lines: list[str] = []
    log.print_fn = lines.append
    log.enable(verbose=True, debug=True)
    rec = log.begin("all_reduce", (0, 1), 2**20)
    assert isinstance(rec, PendingRecord)
    rec.finish()
    assert len(lines) == 1 and "msg size: 1.00 MB" in lines[0] and "busbw" in lines[0]
    (key,) = log.summary()
    assert key[0] == f"all_reduce [{__name__}.test_verbose_debug_and_log_summary]"
    assert log.bytes_for("all_reduce") == 2**20 and log.count_for("all_reduce", (0, 1)) == 1

    log.reset()
    log.enable()
    log._stats[("all_reduce", (0, 1))] = Stats(count=2, bytes=2 * 10**9, total_time_s=2.0)
    log._stats[("all_gather_into_tensor", (0, 1, 2, 3))] = Stats(count=1, bytes=10**9, total_time_s=0.5)
    out: list[str] = []
    log.log_summary(print_fn=out.append)
    table = out[0].splitlines()
    assert table[0].split()[:3] == ["Comm.", "Op", "Group"]
    gather = next(r for r in table if r.startswith("all_gather_into_tensor")).split()
    # count, MB, avg ms, algbw = 1e9/0.5 = 2 GB/s, busbw = 2 * 3/4 = 1.5
    assert gather[2:] == ["1", f"{10**9 / 2**20:.3f}", "500.000", "2.000", "1.500"]
    allreduce = next(r for r in table if r.startswith("all_reduce")).split()
    assert allreduce[2:] == ["2", f"{2 * 10**9 / 2**20:.3f}", "1000.000", "1.000", "1.000"]


def test_bus_bandwidth_factors():
    assert bus_bandwidth_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_bandwidth_factor("reduce_scatter_tensor", 4) == pytest.approx(0.75)
    assert bus_bandwidth_factor("broadcast", 4) == 1.0
    assert bus_bandwidth_factor("all_reduce", 1) == 0.0
