"""Multi-rank test harness: run a function on N gloo-connected CPU processes from pytest.

Two submodules, imported explicitly (they import torch, this module does not), hold what parity
tests share: ``zero_core.testing.models`` (small reference models and seeded batches, see
[Note: reference models]) and ``zero_core.testing.parity`` (train with plain PyTorch and with an
engine on the same data, compare; see [Note: parity runs]).

Usage::

    import torch
    import torch.distributed as dist
    from zero_core.testing import multirank, run_multirank

    def _allreduce_rank():  # runs on every rank; a process group is already initialised
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_allreduce():
        assert run_multirank(_allreduce_rank, 2) == [1.0, 1.0]   # one result per rank

    @multirank(world_sizes=(1, 2, 4), timeout=60)
    def test_sum(tmp_path, world_size):                          # fixtures + world_size
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world_size

``run_multirank(fn, world_size, *, args=(), kwargs=None, timeout=120.0, backend="gloo",
env=None) -> list`` returns ``fn``'s result on each rank, in rank order. Failures raise
:class:`RankFailedError` (every failing rank's traceback, rank named; ``.failed_ranks``) and
timeouts :class:`RankTimeoutError` (ranks that did not finish, their stacks at the timeout;
``.unfinished_ranks``); both derive from :class:`MultiRankError`, and the harness kills any
rank still running, so a test never hangs.

[Note: forked ranks]
Ranks are forked from the calling process (``multiprocessing`` "fork" context), not spawned:
spawning re-imports torch in every rank (about 1.5 s each on this 2-core machine), while a
fork costs milliseconds (a 2-rank trivial job takes ~0.05 s end to end). Consequences:

* ``fn`` is never pickled, so closures, lambdas and functions defined inside tests (or in
  test modules imported by pytest's ``importlib`` mode, which a spawned child could not
  re-import) all work; ``args``/``kwargs`` are inherited, not pickled, too. Only the
  *return values* (and exceptions) travel back through a pipe, so they must be picklable;
  an unpicklable result is reported as that rank's failure.
* Each rank calls ``torch.set_num_threads(1)`` before any torch work, so an OpenMP pool
  created by the parent is never used in a child (libgomp is not fork-safe).
* The calling process must not hold a default process group (checked: it would be
  inherited). Run from the main thread of a process that is not itself a rank.
* The rendezvous port cannot be stolen: the parent binds and listens on a socket on an
  ephemeral 127.0.0.1 port before forking, and rank 0 hosts the ``TCPStore`` on that
  inherited socket (``master_listen_fd``). ``MASTER_ADDR``/``MASTER_PORT`` name it.
* The process-group timeout equals ``timeout``, so a collective whose peer is stuck fails
  inside the ranks too. Stragglers are asked for their Python stacks (faulthandler on
  SIGUSR1) and then SIGKILLed; the stacks appear in the :class:`RankTimeoutError` message.
* On success, ranks meet at a barrier and call ``destroy_process_group()`` (unless ``fn``
  destroyed it already), then leave with ``os._exit`` so no inherited atexit handler runs.
"""

from zero_core.testing.decorator import multirank
from zero_core.testing.multirank import MultiRankError, RankFailedError, RankTimeoutError, run_multirank

__all__ = ["MultiRankError", "RankFailedError", "RankTimeoutError", "multirank", "run_multirank"]
