"""Run one function in ``world_size`` forked processes joined by a process group (gloo by
default; NCCL with one GPU per rank for the GPU lane, see [Note: GPU test lane]).

See [Note: forked ranks] for why the ranks are forked rather than spawned.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

_HOST = "127.0.0.1"
# After the first rank fails, how long the others get to finish (or fail) on their own before
# they are killed: long enough to collect a second, related error, short enough to fail fast.
_GRACE_AFTER_FAILURE_S = 2.0
# How long a straggler gets to write its stack (faulthandler on SIGUSR1) before SIGKILL.
_STACK_DUMP_WAIT_S = 0.5


class MultiRankError(RuntimeError):
    """Base class of the errors raised by :func:`run_multirank`."""


class RankFailedError(MultiRankError):
    """At least one rank raised an exception or died; the message holds its traceback."""

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


class RankTimeoutError(MultiRankError):
    """At least one rank had not finished when the timeout expired; those ranks were killed."""

    def __init__(self, message: str, unfinished_ranks: list[int]) -> None:
        super().__init__(message)
        self.unfinished_ranks = unfinished_ranks


def _validate(
    fn: object,
    world_size: object,
    args: object,
    kwargs: object,
    timeout: object,
    backend: object,
    env: object,
) -> None:
    if not callable(fn):
        raise TypeError(f"run_multirank: fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_multirank: world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"run_multirank: args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"run_multirank: kwargs must be a mapping or None, got {type(kwargs).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"run_multirank: timeout must be a positive number of seconds, got {timeout!r}")
    if backend not in ("gloo", "nccl", "mpi", "auto"):
        raise ValueError(
            f"run_multirank: backend must be one of 'gloo', 'nccl', 'mpi', 'auto', got {backend!r}"
        )
    if env is not None:
        if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise TypeError("run_multirank: env must be a mapping of str to str (environment variables)")


def _join_group(
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    listen_fd: int,
    port: int,
    env: Mapping[str, str],
) -> ModuleType:
    """Set this rank's environment and join the process group; returns ``torch.distributed``."""
    os.environ.update(
        {
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": _HOST,
            "MASTER_PORT": str(port),
        }
    )
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _set_rank_device(backend, rank)
    pg_timeout = datetime.timedelta(seconds=timeout)
    if rank == 0:
        # See [Note: forked ranks]: the listening socket was bound by the parent.
        store = dist.TCPStore(
            _HOST, port, world_size, True, pg_timeout, wait_for_workers=False, master_listen_fd=listen_fd
        )
    else:
        os.close(listen_fd)
        store = dist.TCPStore(_HOST, port, world_size, False, pg_timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout)
    return dist


def _resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"``: NCCL with one GPU per rank where CUDA has enough devices, else gloo."""
    from zero_core.testing.gpu_lane import choose_backend, cuda_device_count

    if backend == "auto":
        return choose_backend(world_size)
    if backend == "nccl" and cuda_device_count() < world_size:
        raise ValueError(
            f"run_multirank: backend 'nccl' needs one CUDA device per rank ({world_size}), "
            f"this machine has {cuda_device_count()}; use backend='auto' to fall back to gloo"
        )
    return backend


def _set_rank_device(backend: str, rank: int) -> None:
    """With NCCL, rank r computes on GPU r (before joining the group): See [Note: GPU test lane]."""
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)


def _child_main(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    listen_fd: int,
    port: int,
    env: Mapping[str, str],
    conn: mp_connection.Connection,
    stack_file: str,
) -> None:
    """Body of one rank.

    Messages on ``conn``: ``("result", value)`` once ``fn`` returned, ``("closed",)`` once the
    group is torn down, or ``("error", phase, unix_time, traceback_text, exc_or_None)`` where
    phase is "init", "fn" or "teardown".
    """
    # Written by faulthandler when the parent asks for the stack of a straggler.
    stack_fh = open(stack_file, "w")  # must outlive this frame until os._exit
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)
    status = 0
    phase = "init"
    try:
        dist = _join_group(rank, world_size, backend, timeout, listen_fd, port, env)
        phase = "fn"
        result = fn(*args, **kwargs)
        try:
            # Plain pickle, not the connection's ForkingPickler: torch registers reductions
            # that pass tensors through shared memory whose sender must outlive the
            # receiver's read, which a rank that exits right after sending does not.
            conn.send_bytes(pickle.dumps(("result", result)))
        except Exception as exc:  # an unpicklable result
            raise TypeError(f"rank {rank} returned a result that cannot be pickled: {exc!r}") from exc
        phase = "teardown"
        if dist.is_initialized():
            # Keep rank 0 (which hosts the store) alive until every rank is done with the group.
            dist.barrier()
            dist.destroy_process_group()
        conn.send(("closed",))
    except BaseException as exc:  # everything is reported to the parent
        status = 1
        text = traceback.format_exc()
        when = time.time()
        try:
            conn.send(("error", phase, when, text, exc))
        except Exception:  # the exception itself does not pickle: send the text only
            try:
                conn.send(("error", phase, when, text, None))
            except Exception:
                pass
    finally:
        try:
            conn.close()
            stack_fh.close()
        finally:
            # Skip atexit handlers and destructors inherited from the parent (pytest, gloo).
            os._exit(status)


def _bind_listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((_HOST, 0))
    sock.listen(128)
    return sock


def _kill(procs: dict[int, Any], ranks: list[int], stack_files: list[str]) -> dict[int, str]:
    """Ask ``ranks`` for their Python stacks, then SIGKILL them; returns rank -> stack text."""
    for r in ranks:
        if procs[r].is_alive() and procs[r].pid is not None:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    if ranks:
        time.sleep(_STACK_DUMP_WAIT_S)
    for r in ranks:
        if procs[r].is_alive():
            procs[r].kill()
    for r in ranks:
        procs[r].join(5.0)
    stacks: dict[int, str] = {}
    for r in ranks:
        try:
            with open(stack_files[r]) as f:
                stacks[r] = f.read().strip()
        except OSError:
            stacks[r] = ""
    return stacks


def run_multirank(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results, rank order.

    Each rank is a forked child with ``torch.distributed`` initialised (``backend`` on
    127.0.0.1), ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` and
    ``OMP_NUM_THREADS=1`` set, ``torch.set_num_threads(1)`` called, plus ``env`` on top.
    After ``fn`` returns, the ranks meet at a barrier and destroy the process group.

    Raises :class:`RankFailedError` with the failing ranks' tracebacks when a rank raises or
    dies, and :class:`RankTimeoutError` naming the unfinished ranks (with their stacks) when
    ``timeout`` seconds pass; stragglers are killed in both cases, so a test never hangs.
    See [Note: forked ranks] for what ``fn`` may be.
    """
    _validate(fn, world_size, args, kwargs, timeout, backend, env)
    backend = _resolve_backend(backend, world_size)
    if "fork" not in mp.get_all_start_methods():
        raise RuntimeError("run_multirank needs the 'fork' start method (Linux or macOS)")
    import torch._dynamo  # noqa: F401
    import torch.distributed as dist

    # torch._dynamo above: a process's first torch optimizer imports it (2-4 s of CPU on a
    # 2-core machine). Imported here, in the calling process, the forked ranks inherit it;
    # otherwise every rank of every test would import it again until the caller itself did.
    # The import starts no threads, so forking stays safe.
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "run_multirank: this process already has a default process group; the forked ranks would "
            "inherit it. Call torch.distributed.destroy_process_group() before run_multirank."
        )
    ctx = mp.get_context("fork")
    listener = _bind_listener()
    port = listener.getsockname()[1]
    tmpdir = tempfile.mkdtemp(prefix="zero_multirank_")
    stack_files = [os.path.join(tmpdir, f"stack_rank{r}.txt") for r in range(world_size)]
    procs: dict[int, Any] = {}
    conns: dict[int, mp_connection.Connection] = {}
    try:
        for r in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child_main,
                args=(
                    fn,
                    tuple(args),
                    dict(kwargs or {}),
                    r,
                    world_size,
                    backend,
                    float(timeout),
                    listener.fileno(),
                    port,
                    dict(env or {}),
                    send_end,
                    stack_files[r],
                ),
                name=f"zero-rank{r}",
                daemon=True,
            )
            p.start()
            send_end.close()
            procs[r], conns[r] = p, recv_end
        listener.close()
        return _collect(procs, conns, stack_files, world_size, float(timeout))
    finally:
        listener.close()
        _clean_up(procs, conns, stack_files, tmpdir)


def _clean_up(
    procs: dict[int, Any], conns: dict[int, mp_connection.Connection], stack_files: list[str], tmpdir: str
) -> None:
    """Kill the ranks still alive, close the pipes, remove the stack files and their directory."""
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join(5.0)
    for c in conns.values():
        c.close()
    for f in stack_files:
        try:
            os.unlink(f)
        except OSError:
            pass
    try:
        os.rmdir(tmpdir)
    except OSError:
        pass


def _collect(
    procs: dict[int, Any],
    conns: dict[int, mp_connection.Connection],
    stack_files: list[str],
    world_size: int,
    timeout: float,
) -> list[Any]:
    """Wait for every rank (or the deadline), then return the results or raise."""
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    closed: set[int] = set()
    # rank -> (phase, unix time, text); a death without a message counts as a failure in "fn".
    errors: dict[int, tuple[str, float, str]] = {}
    causes: dict[int, BaseException] = {}
    open_conns = dict(conns)
    running = dict(procs)

    def shorten_deadline() -> None:
        nonlocal deadline
        deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)

    while open_conns or running:
        now = time.monotonic()
        if now >= deadline:
            break
        waitables: list[Any] = [*open_conns.values(), *(p.sentinel for p in running.values())]
        ready = mp_connection.wait(waitables, timeout=deadline - now)
        for r, c in list(open_conns.items()):
            if c not in ready:
                continue
            try:
                msg = c.recv()
            except (EOFError, OSError):
                del open_conns[r]  # the rank exited; its exit status is judged below
                continue
            if msg[0] == "result":
                results[r] = msg[1]
            elif msg[0] == "closed":
                closed.add(r)
            else:
                _, phase, when, text, exc = msg
                errors[r] = (phase, when, text)
                if isinstance(exc, BaseException):
                    causes[r] = exc
                shorten_deadline()
        for r, p in list(running.items()):
            if p.sentinel in ready:
                p.join()
                del running[r]
                if p.exitcode != 0:
                    shorten_deadline()  # its error message, if any, may still be in the pipe
    for r in range(world_size):
        code = procs[r].exitcode
        if code is not None and code != 0 and r not in errors:
            phase = "teardown" if r in results else "fn"
            errors[r] = (phase, time.time(), f"rank {r} exited with {_describe_exit(code)} without reporting")

    in_fn = sorted(r for r in range(world_size) if r not in results and r not in errors)
    in_teardown = sorted(r for r in results if r not in closed and r not in errors and procs[r].exitcode != 0)
    stacks = _kill(procs, in_fn + in_teardown, stack_files)
    _raise_failures(errors, causes, results, closed, in_fn, in_teardown, stacks, world_size, timeout)
    return [results[r] for r in range(world_size)]


def _raise_failures(
    errors: dict[int, tuple[str, float, str]],
    causes: dict[int, BaseException],
    results: dict[int, Any],
    closed: set[int],
    in_fn: list[int],
    in_teardown: list[int],
    stacks: dict[int, str],
    world_size: int,
    timeout: float,
) -> None:
    """Raise the error that describes what went wrong (failures first, then a timeout, then a
    failed teardown); return when every rank returned and tore down cleanly."""
    fn_failures = sorted((e[1], r) for r, e in errors.items() if e[0] != "teardown")
    teardown_failures = sorted((e[1], r) for r, e in errors.items() if e[0] == "teardown")

    if fn_failures:
        ranks = [r for _, r in fn_failures]
        parts = [
            f"{len(ranks)} of {world_size} ranks failed; first failure on rank {ranks[0]} (in time order: {ranks})"
        ]
        parts += [f"\n===== rank {r} =====\n{errors[r][2].rstrip()}" for r in ranks]
        if in_fn:
            parts.append(f"\n(rank(s) {in_fn} were still running and were killed)")
        if teardown_failures:
            later = [r for _, r in teardown_failures]
            parts.append(f"\n(rank(s) {later} returned, then failed in the final barrier/teardown)")
        raise RankFailedError("\n".join(parts), ranks) from causes.get(ranks[0])
    if in_fn:
        parts = [
            f"run_multirank timed out after {timeout:g} s: rank(s) {in_fn} of world size {world_size} "
            f"did not finish and were killed"
        ]
        waiting = sorted(set(results) - closed)
        if waiting:
            parts.append(f"(rank(s) {waiting} had returned and were waiting for them in the final barrier)")
        for r in in_fn:
            parts.append(f"\n===== rank {r} stack at timeout =====\n{stacks.get(r) or '(no stack captured)'}")
        raise RankTimeoutError("\n".join(parts), in_fn)
    if teardown_failures or in_teardown:
        ranks = sorted([r for _, r in teardown_failures] + in_teardown)
        parts = [f"every rank returned, but rank(s) {ranks} failed to tear down the process group"]
        parts += [f"\n===== rank {r} =====\n{errors[r][2].rstrip()}" for _, r in teardown_failures]
        parts += [f"\n===== rank {r} (stuck) =====\n{stacks.get(r) or ''}" for r in in_teardown]
        raise RankFailedError("\n".join(parts), ranks)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
