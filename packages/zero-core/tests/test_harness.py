"""The multi-rank harness: results, failures, timeouts, world sizes, the pytest decorator."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from zero_core.testing import MultiRankError, RankFailedError, RankTimeoutError, multirank, run_multirank


def _rank_info(scale):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t.item() * scale,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["OMP_NUM_THREADS"]),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_collected_per_rank(world_size):
    out = run_multirank(_rank_info, world_size, args=(2.0,))
    expected_sum = 2.0 * world_size * (world_size + 1) / 2
    assert [o["rank"] for o in out] == list(range(world_size))
    for r, o in enumerate(out):
        assert o["world"] == world_size
        assert o["sum"] == expected_sum
        assert o["env"] == (str(r), str(world_size), "1")
        assert o["threads"] == 1
        assert o["backend"] == "gloo"


def test_closures_kwargs_and_env_reach_the_ranks():
    captured = torch.arange(4.0)  # inherited through fork, never pickled

    def body(offset, *, factor):
        return (captured * factor + offset + dist.get_rank()).tolist(), os.environ["ZERO_TEST_FLAG"]

    out = run_multirank(body, 2, args=(1.0,), kwargs={"factor": 3.0}, env={"ZERO_TEST_FLAG": "yes"})
    assert out[0] == ([1.0, 4.0, 7.0, 10.0], "yes")
    assert out[1] == ([2.0, 5.0, 8.0, 11.0], "yes")


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom from the second rank")
    return "fine"


def test_failing_rank_traceback_is_reported():
    with pytest.raises(RankFailedError) as info:
        run_multirank(_fail_on_rank1, 2, timeout=30)
    msg = str(info.value)
    assert info.value.failed_ranks == [1]
    assert "===== rank 1 =====" in msg
    assert "ValueError: boom from the second rank" in msg
    assert "_fail_on_rank1" in msg  # the frame of the failing function is in the traceback
    assert isinstance(info.value.__cause__, ValueError)


def _fail_then_others_block():
    if dist.get_rank() == 1:
        raise KeyError("missing")
    dist.barrier()  # rank 0 waits for rank 1 forever; the harness must not wait for it


def test_failure_with_blocked_peers_fails_fast():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_multirank(_fail_then_others_block, 2, timeout=60)
    assert time.monotonic() - start < 20
    # rank 0 may fail too (its peer vanished), but rank 1 is named as the first failure
    assert info.value.failed_ranks[0] == 1
    assert "first failure on rank 1" in str(info.value)
    assert "KeyError" in str(info.value)


def _hang_on_rank1():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


def test_hanging_rank_times_out_and_is_named():
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_multirank(_hang_on_rank1, 2, timeout=5)
    elapsed = time.monotonic() - start
    assert elapsed < 15, elapsed
    msg = str(info.value)
    assert "timed out after 5 s" in msg
    assert "rank(s) [1] of world size 2 did not finish" in msg
    assert "rank(s) [0] had returned" in msg
    assert info.value.unfinished_ranks == [1]
    # the straggler's stack was captured before it was killed
    assert "_hang_on_rank1" in msg


def test_rank_dying_without_result_is_reported():
    def body():
        if dist.get_rank() == 0:
            os._exit(7)
        return 1

    with pytest.raises(RankFailedError, match=r"rank 0 exited with exit code 7"):
        run_multirank(body, 2, timeout=30)


def test_unpicklable_result_is_reported():
    def body():
        return lambda: None

    with pytest.raises(RankFailedError, match="cannot be pickled"):
        run_multirank(body, 1, timeout=30)


def test_parent_with_a_busy_thread_pool_can_fork_ranks():
    # The parent has run multi-threaded kernels; the forked ranks must still compute correctly.
    # float64: a float32 sum of 360,000 products depends on the kernel's blocking, which differs
    # between 2 threads here and 1 in the ranks (an error of ~2e-3 on |sum| ~ 25 was seen).
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(600, 600, dtype=torch.float64)
        expected = (a @ a).sum()
    finally:
        torch.set_num_threads(before)

    def body():
        return (a @ a).sum(), torch.get_num_threads()

    for got, threads in run_multirank(body, 2, timeout=60):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
        assert threads == 1


def test_process_group_is_destroyed_in_children_and_parent_untouched():
    # The parent never initialises a group; a second run works, so nothing leaked.
    assert run_multirank(dist.get_world_size, 2) == [2, 2]
    assert not dist.is_initialized()
    assert run_multirank(dist.get_rank, 2) == [0, 1]


def test_trivial_two_rank_overhead_is_small():
    """Forked ranks skip the interpreter start and the torch import a spawned rank pays (see
    [Note: forked ranks]): a whole 2-rank run costs less than one fresh ``import torch``, both
    measured here under the same machine load (an absolute limit failed on loaded CI machines)."""
    run_multirank(dist.get_rank, 2)  # warm
    start = time.monotonic()
    run_multirank(dist.get_rank, 2)
    forked = time.monotonic() - start
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True)
    spawned = time.monotonic() - start
    assert forked < spawned, (forked, spawned)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"world_size": 2, "timeout": 0}, "timeout must be a positive"),
        ({"world_size": 2, "backend": "tcp"}, "backend must be one of"),
        ({"world_size": 2, "args": 3}, "args must be a tuple or list"),
        ({"world_size": 2, "env": {"A": 1}}, "env must be a mapping of str to str"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        run_multirank(dist.get_rank, **kwargs)


def test_not_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        run_multirank(42, 2)


def test_errors_share_a_base_class():
    assert issubclass(RankFailedError, MultiRankError) and issubclass(RankTimeoutError, MultiRankError)


@multirank(world_sizes=(1, 2, 4), timeout=60)
def test_decorator_parametrizes_world_sizes(tmp_path, world_size):
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(world_size)] * 2
    (tmp_path / f"rank{dist.get_rank()}").write_text("x")
    dist.barrier()
    assert len(list(tmp_path.iterdir())) == world_size  # the fixture is shared by all ranks


def test_decorator_reports_rank_failure():
    @multirank(world_sizes=(2,), timeout=30)
    def body():
        assert dist.get_rank() == 0, "only rank 0 passes"

    # pytest.mark.parametrize wraps the function; call it the way pytest would.
    with pytest.raises(RankFailedError, match="only rank 0 passes"):
        body(world_size=2)


def test_decorator_validates_world_sizes():
    with pytest.raises(ValueError, match="world_sizes"):
        multirank(world_sizes=())
    with pytest.raises(ValueError, match="world_sizes"):
        multirank(world_sizes=(2, 0))
