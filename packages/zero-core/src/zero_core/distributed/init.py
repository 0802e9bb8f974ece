"""``init_distributed``: join (or form) the job's default process group, whatever launched it.

Semantics follow ``deepspeed.init_distributed``: find rank, world size and the rendezvous
(see [Note: world discovery order] in ``world_info.py``), export them as the env:// variables
(so later code and libraries see one consistent world), then call
``torch.distributed.init_process_group``. A world that does not form within ``timeout`` is
reported with everything needed to debug it.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zero_core.distributed import teardown
from zero_core.distributed.world_info import (
    DEFAULT,
    EXPLICIT,
    MPI,
    TORCHRUN,
    WorldDiscoveryError,
    WorldInfo,
    discover_world,
)

logger = logging.getLogger(__name__)

# The world this process joined through init_distributed, with (a weak reference to) the default group it created:
# the info is only trusted while that very group is the default one (it may be destroyed and
# replaced by other code, or this module state inherited by a forked child).
_joined: tuple[WorldInfo, Any] | None = None


DEFAULT_PG_TIMEOUT = timedelta(minutes=30)


class DistributedInitError(RuntimeError):
    """The process group could not be formed; the message names rank, world size, master
    address and port, and where that world information came from."""


def _validate(
    dist_backend: Any,
    distributed_port: Any,
    timeout: Any,
    init_method: Any,
    dist_init_required: Any,
    rank: Any,
    world_size: Any,
    auto_mpi_discovery: Any,
    verbose: Any,
) -> None:
    where = "init_distributed"
    if dist_backend is not None and (not isinstance(dist_backend, str) or not dist_backend):
        raise TypeError(
            f"{where}: dist_backend must be None or a backend name such as 'gloo' or 'nccl', got {dist_backend!r}"
        )
    if (
        isinstance(distributed_port, bool)
        or not isinstance(distributed_port, int)
        or not 0 < distributed_port < 65536
    ):
        raise ValueError(f"{where}: distributed_port must be an int in 1..65535, got {distributed_port!r}")
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(
            f"{where}: timeout must be a positive datetime.timedelta (or None: 30 minutes), got {timeout!r}"
        )
    if init_method is not None and (not isinstance(init_method, str) or "://" not in init_method):
        raise ValueError(
            f"{where}: init_method must be None or a URL such as 'env://', 'tcp://host:port' or 'file:///path', got {init_method!r}"
        )
    if dist_init_required is not None and not isinstance(dist_init_required, bool):
        raise TypeError(
            f"{where}: dist_init_required must be None, True or False, got {dist_init_required!r}"
        )
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}: {name} must be an int (-1 = discover), got {value!r}")
    for name, value in (("auto_mpi_discovery", auto_mpi_discovery), ("verbose", verbose)):
        if not isinstance(value, bool):
            raise TypeError(f"{where}: {name} must be a bool, got {value!r}")


def default_backend() -> str:
    """The accelerator's backend: gloo on CPU, nccl on CUDA."""
    try:
        from zero_core.accelerator import get_accelerator
    except ImportError:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return get_accelerator().communication_backend_name()


def _apply_comm_config(config: Any) -> None:
    """DeepSpeed's ``init_distributed(config=...)`` configures communication logging: take
    the ``comms_logger`` section from a config dict, a JSON path or a config object."""
    if config is None:
        return
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"init_distributed: cannot read config {os.fspath(config)!r}: {exc}") from exc
    if isinstance(config, dict):
        section = config.get("comms_logger")
    else:
        section = getattr(config, "comms_logger", None)
    if section is not None:
        from zero_core.comm import comms_logger

        comms_logger.configure(section)


def _set_local_device(info: WorldInfo) -> None:
    """Bind this process to the accelerator device of its local rank, before the group forms.

    Without it every rank of a node computes (and NCCL communicates) on device 0. A CPU
    accelerator has one device and nothing to bind; a local rank with no device of its own is
    an error from the accelerator's ``set_device`` naming the visible count.
    """
    from zero_core.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return
    accelerator.set_device(info.local_rank)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _discovered_world(
    rank: int, world_size: int, auto_mpi_discovery: bool, distributed_port: int, init_method: str | None
) -> Any:
    """This process's place in the world (launcher variables, MPI, Slurm or the arguments),
    exported to the environment for ``env://``; a clear error when it cannot be found."""
    try:
        info = discover_world(
            rank=rank,
            world_size=world_size,
            auto_mpi_discovery=auto_mpi_discovery,
            distributed_port=distributed_port,
        )
        if info.source == MPI:
            from zero_core.distributed.mpi import agree_over_mpi

            info = agree_over_mpi(info, os.environ)
    except WorldDiscoveryError as exc:
        raise DistributedInitError(f"init_distributed: {exc}") from exc
    if info.source == DEFAULT and info.master_port is None:
        # One process rendezvouses with itself: any free port will do, and a fixed one would
        # collide with other single-process jobs on the same machine.
        info = dataclasses.replace(info, master_port=_free_port())
    if init_method is None or init_method == "env://":
        # Export the world so env:// and any later reader (libraries, children) agree on it.
        os.environ.update(
            {
                "RANK": str(info.rank),
                "WORLD_SIZE": str(info.world_size),
                "LOCAL_RANK": str(info.local_rank),
                "MASTER_ADDR": str(info.master_addr),
                "MASTER_PORT": str(info.master_port),
            }
        )
    return info


def _bound_collectives(timeout: timedelta | None) -> None:
    """A timeout given explicitly also bounds zero's collectives (the user's own bound: See
    [Note: collective watchdog]); set only once there is a process group it applies to, so an
    ``init_distributed`` that failed leaves no bound behind for a later group of the process."""
    if timeout is not None:
        from zero_core.comm import watchdog

        watchdog.set_init_timeout(timeout.total_seconds())


def _form_group(backend: str, init_method: str | None, timeout: timedelta | None, info: WorldInfo) -> None:
    """``init_process_group``; a world that does not form is a ``DistributedInitError`` saying why."""
    try:
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            timeout=timeout or DEFAULT_PG_TIMEOUT,
            rank=info.rank,
            world_size=info.world_size,
        )
    except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
        rendezvous = init_method or f"tcp://{info.master_addr}:{info.master_port} (env://)"
        raise DistributedInitError(
            f"init_distributed: the process group did not form (backend {backend}, timeout "
            f"{(timeout or DEFAULT_PG_TIMEOUT).total_seconds():g} s): {info.describe()}; rendezvous {rendezvous}. Check that all "
            f"{info.world_size} processes were started, agree on the master address and port, and can reach "
            f"it. Cause: {type(exc).__name__}: {exc}"
        ) from exc


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise ``torch.distributed`` for this job (``deepspeed.init_distributed``).

    Works under torchrun / ``zero run`` (env://), ``mpiexec``/``mpirun`` (rank and size from
    mpi4py, rendezvous agreed over MPI), Slurm ``srun`` (SLURM_* variables), with an explicit
    ``rank``/``world_size``, or as a single process. ``dist_backend`` defaults to the
    accelerator's (gloo on CPU, nccl on CUDA). On a GPU accelerator the process's device is set
    to its local rank (``set_device(local_rank)``) before the group forms. ``dist_init_required=False`` skips
    initialisation; an already initialised group makes this a no-op. ``config`` (dict, JSON
    path or config object) may carry a ``comms_logger`` section, which is applied.

    ``timeout`` (default 30 minutes) bounds forming the group and is the process group's own
    timeout; given explicitly, it also bounds every collective of zero unless the config's
    ``comms_timeout`` or ``ZERO_COLLECTIVE_TIMEOUT`` says otherwise (see [Note: collective
    watchdog]; the default there is 300 s).

    Raises :class:`DistributedInitError` when the world does not form within ``timeout``.
    """
    global _joined
    _validate(
        dist_backend,
        distributed_port,
        timeout,
        init_method,
        dist_init_required,
        rank,
        world_size,
        auto_mpi_discovery,
        verbose,
    )
    _apply_comm_config(config)
    if dist_init_required is False or dist.is_initialized():
        _bound_collectives(timeout)
    if dist_init_required is False:
        return
    if dist.is_initialized():
        if verbose:
            logger.info("init_distributed: torch.distributed is already initialised; nothing to do")
        return
    backend = dist_backend or default_backend()
    if not dist.is_backend_available(backend):
        raise ValueError(
            f"init_distributed: backend {backend!r} is not available in this torch build; "
            f"available: {[b for b in ('gloo', 'nccl', 'mpi', 'ucc', 'xccl') if dist.is_backend_available(b)]}"
        )
    info = _discovered_world(rank, world_size, auto_mpi_discovery, distributed_port, init_method)
    _set_local_device(info)
    if verbose:
        logger.info("init_distributed: backend %s, %s", backend, info.describe())
    _form_group(backend, init_method, timeout, info)
    _bound_collectives(timeout)
    _joined = (info, weakref.ref(dist.group.WORLD))  # weakly: see [Note: process group teardown at exit]
    atexit.register(teardown.destroy_at_exit, weakref.ref(dist.group.WORLD))
    from zero_core.comm import failures

    failures.install()  # a process ending with an error says so: See [Note: failed ranks]


def world_info() -> WorldInfo:
    """This process's place in the job.

    After :func:`init_distributed`: the world it joined. When torch.distributed was
    initialised some other way: rank and size from torch.distributed, the rest from the
    environment. Before initialisation: what the environment says (nothing is contacted, so
    an MPI job's rendezvous is not known yet).
    """
    initialised = dist.is_available() and dist.is_initialized()
    if _joined is not None and initialised and _joined[1]() is dist.group.WORLD:
        return _joined[0]
    env_info = discover_world()
    if not initialised:
        return env_info
    rank, size = dist.get_rank(), dist.get_world_size()
    if (env_info.rank, env_info.world_size) == (rank, size) and env_info.source != DEFAULT:
        return env_info
    local = int(os.environ["LOCAL_RANK"]) if os.environ.get("LOCAL_RANK", "").isdigit() else rank
    port = os.environ.get("MASTER_PORT", "")
    source = TORCHRUN if "RANK" in os.environ and "WORLD_SIZE" in os.environ else EXPLICIT
    return WorldInfo(
        rank, size, local, os.environ.get("MASTER_ADDR"), int(port) if port.isdigit() else None, source
    )
