"""Where the world comes from: rank, world size and rendezvous address, read from the
launcher's environment (torchrun, MPI, Slurm) or given explicitly.

See [Note: world discovery order] for which source wins when several are present.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Literal

Source = Literal["torchrun env", "MPI", "Slurm", "explicit", "default (single process)"]

TORCHRUN: Source = "torchrun env"
MPI: Source = "MPI"
SLURM: Source = "Slurm"
EXPLICIT: Source = "explicit"
DEFAULT: Source = "default (single process)"

# (rank, size, local rank) variables of the MPI launchers: Open MPI, then MPICH/Intel MPI (hydra).
_MPI_ENV_SETS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
)


class WorldDiscoveryError(RuntimeError):
    """The launcher's environment is incomplete or inconsistent."""


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """Who this process is in the job, and where the job meets.

    ``master_addr``/``master_port`` are None when not yet known (an MPI job before
    :func:`~zero_core.distributed.init_distributed` agreed on them over MPI).
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: Source

    def describe(self) -> str:
        """One line for error messages: rank, world size, rendezvous and where they came from."""
        where = (
            f"{self.master_addr}:{self.master_port}" if self.master_addr else "(rendezvous not yet agreed)"
        )
        return f"rank {self.rank} of world size {self.world_size} (local rank {self.local_rank}), master {where}, from {self.source}"


def _int_var(env: Mapping[str, str], name: str, source: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise WorldDiscoveryError(
            f"{source}: environment variable {name}={raw!r} is not an integer"
        ) from None


def _check(rank: int, world_size: int, local_rank: int, source: str) -> None:
    if world_size < 1:
        raise WorldDiscoveryError(f"{source}: world size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise WorldDiscoveryError(
            f"{source}: rank {rank} is outside [0, {world_size}) for world size {world_size}"
        )
    if local_rank < 0:
        raise WorldDiscoveryError(f"{source}: local rank must be >= 0, got {local_rank}")


def _port(env: Mapping[str, str], default: int | None, source: str) -> int | None:
    if "MASTER_PORT" not in env:
        return default
    port = _int_var(env, "MASTER_PORT", source)
    if not 0 < port < 65536:
        raise WorldDiscoveryError(f"{source}: MASTER_PORT={port} is not a valid TCP port (1-65535)")
    return port


def mpi_env_vars(env: Mapping[str, str]) -> tuple[str, str, str] | None:
    """The (rank, size, local rank) variable names set by an MPI launcher in ``env``, if any."""
    for names in _MPI_ENV_SETS:
        if names[0] in env and names[1] in env:
            return names
    return None


def from_torchrun_env(env: Mapping[str, str]) -> WorldInfo:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT as set by torchrun (env://)."""
    rank = _int_var(env, "RANK", TORCHRUN)
    size = _int_var(env, "WORLD_SIZE", TORCHRUN)
    local = _int_var(env, "LOCAL_RANK", TORCHRUN) if "LOCAL_RANK" in env else rank
    _check(rank, size, local, TORCHRUN)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in env]
    if missing and size > 1:
        raise WorldDiscoveryError(
            f"{TORCHRUN}: RANK and WORLD_SIZE are set but {' and '.join(missing)} not; "
            "set them, or launch with `zero run` / torchrun, which set all five"
        )
    return WorldInfo(rank, size, local, env.get("MASTER_ADDR"), _port(env, None, TORCHRUN), TORCHRUN)


def from_mpi_env(env: Mapping[str, str]) -> WorldInfo:
    """Rank and size from the MPI launcher's variables; the rendezvous is agreed later, over
    MPI, unless MASTER_ADDR/MASTER_PORT are set."""
    names = mpi_env_vars(env)
    if names is None:
        raise WorldDiscoveryError("MPI: none of OMPI_COMM_WORLD_*, PMI_RANK/PMI_SIZE, PMIX_* is set")
    rank, size = _int_var(env, names[0], MPI), _int_var(env, names[1], MPI)
    local = _int_var(env, names[2], MPI) if names[2] in env else rank
    _check(rank, size, local, MPI)
    return WorldInfo(rank, size, local, env.get("MASTER_ADDR"), _port(env, None, MPI), MPI)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list such as ``node[03-05,9],gpu1`` (-> ``node03``).

    ``scontrol show hostnames`` is the authority and is used when present; this parser covers
    the documented compact form (one bracket group per host name) for machines without it.
    """
    nodelist = nodelist.strip()
    if shutil.which("scontrol"):
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        hosts = out.stdout.split()
        if out.returncode == 0 and hosts:
            return hosts[0]
    m = re.match(r"^([^,\[\]]+)(?:\[([^\]]+)\])?([^,\[\]]*)(?:,|$)", nodelist)
    if not m:
        raise WorldDiscoveryError(
            f"Slurm: cannot read the first host of SLURM_JOB_NODELIST={nodelist!r} and `scontrol` is not "
            "available; set MASTER_ADDR to the address of the node running rank 0"
        )
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",", 1)[0].split("-", 1)[0]
    if not first.isdigit():
        raise WorldDiscoveryError(
            f"Slurm: malformed host range [{ranges}] in SLURM_JOB_NODELIST={nodelist!r}"
        )
    return prefix + first + suffix


def from_slurm_env(env: Mapping[str, str], distributed_port: int) -> WorldInfo:
    """SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID; master from MASTER_ADDR, else
    SLURM_LAUNCH_NODE_IPADDR, else the first host of SLURM_JOB_NODELIST."""
    rank, size = _int_var(env, "SLURM_PROCID", SLURM), _int_var(env, "SLURM_NTASKS", SLURM)
    local = _int_var(env, "SLURM_LOCALID", SLURM) if "SLURM_LOCALID" in env else rank
    _check(rank, size, local, SLURM)
    addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
    if not addr:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise WorldDiscoveryError(
                "Slurm: SLURM_PROCID/SLURM_NTASKS are set but neither MASTER_ADDR, SLURM_LAUNCH_NODE_IPADDR nor "
                "SLURM_JOB_NODELIST is; set MASTER_ADDR to the address of the node running rank 0"
            )
        addr = first_slurm_host(nodelist)
    return WorldInfo(rank, size, local, addr, _port(env, distributed_port, SLURM), SLURM)


def explicit_world(rank: int, world_size: int, env: Mapping[str, str], distributed_port: int) -> WorldInfo:
    """Rank and world size given by the caller; rendezvous from MASTER_ADDR/MASTER_PORT or
    127.0.0.1 and ``distributed_port``."""
    local = _int_var(env, "LOCAL_RANK", EXPLICIT) if "LOCAL_RANK" in env else rank
    _check(rank, world_size, local, EXPLICIT)
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    return WorldInfo(rank, world_size, local, addr, _port(env, distributed_port, EXPLICIT), EXPLICIT)


def discover_world(
    env: Mapping[str, str] | None = None,
    *,
    rank: int = -1,
    world_size: int = -1,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
) -> WorldInfo:
    """Read the world from ``env`` (default ``os.environ``) without talking to any peer.

    [Note: world discovery order]
    The first match wins:

    1. ``rank``/``world_size`` given (both >= 0 / >= 1): "explicit".
    2. ``RANK`` and ``WORLD_SIZE`` set (torchrun, ``zero run``, or a user who exported them):
       "torchrun env". torchrun inside an ``srun`` or ``mpirun`` allocation lands here, as it
       should: torchrun's numbering is the one the processes share.
    3. ``auto_mpi_discovery`` and an MPI launcher's variables (OMPI_COMM_WORLD_*, PMI_RANK/SIZE,
       PMIX_*): "MPI". The rendezvous (master address, a free port) is agreed over mpi4py by
       ``init_distributed``, unless MASTER_ADDR/MASTER_PORT are set.
    4. ``SLURM_PROCID`` and ``SLURM_NTASKS`` (srun): "Slurm".
    5. Otherwise a single process: "default (single process)", rank 0 of 1 on 127.0.0.1
       (MASTER_PORT if set; else the port is chosen free by ``init_distributed``).
    """
    env = os.environ if env is None else env
    if rank >= 0 or world_size >= 1:
        if rank < 0 or world_size < 1:
            raise WorldDiscoveryError(
                f"explicit world: give both rank (>= 0) and world_size (>= 1), got rank={rank}, world_size={world_size}"
            )
        return explicit_world(rank, world_size, env, distributed_port)
    if "RANK" in env and "WORLD_SIZE" in env:
        return from_torchrun_env(env)
    if auto_mpi_discovery and mpi_env_vars(env) is not None:
        return from_mpi_env(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return from_slurm_env(env, distributed_port)
    return WorldInfo(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), _port(env, None, DEFAULT), DEFAULT)
