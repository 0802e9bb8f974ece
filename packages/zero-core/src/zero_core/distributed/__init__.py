"""Forming the job's process group: ``init_distributed`` and world discovery.

``init_distributed(...)`` mirrors ``deepspeed.init_distributed``; ``world_info()`` tells
who this process is (rank, world size, local rank, rendezvous) and where that came from
("torchrun env", "MPI", "Slurm", "explicit", "default (single process)").
"""

from zero_core.distributed.init import DistributedInitError, default_backend, init_distributed, world_info
from zero_core.distributed.world_info import WorldDiscoveryError, WorldInfo, discover_world, first_slurm_host

__all__ = [
    "DistributedInitError",
    "WorldDiscoveryError",
    "WorldInfo",
    "default_backend",
    "discover_world",
    "first_slurm_host",
    "init_distributed",
    "world_info",
]
