"""init_distributed and world discovery: env parsing (torchrun, MPI, Slurm), MPI agreement,
real initialisation, a real mpiexec job, and the error when a world cannot form."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import zero_core.accelerator as zero_accelerator
from zero_core.distributed import (
    DistributedInitError,
    WorldDiscoveryError,
    WorldInfo,
    discover_world,
    first_slurm_host,
    init_distributed,
    world_info,
)
from zero_core.distributed import mpi as mpi_mod
from zero_core.distributed.init import default_backend
from zero_core.testing import run_multirank

WORLD_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "PMIX_RANK",
    "PMIX_SIZE",
    "PMIX_LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables in os.environ; anything init_distributed exports is undone."""
    for var in WORLD_VARS:
        # setenv first: monkeypatch records the variable's original state (absent included) and
        # restores it, where a bare delenv of an absent variable records nothing, so RANK,
        # WORLD_SIZE ... exported by init_distributed stayed in this xdist worker and made a
        # later test's transformers.TrainingArguments start a process group.
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- discovery from environment dicts -------------------------------------------------


def test_torchrun_env():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.2",
        "MASTER_PORT": "1234",
    }
    assert discover_world(env) == WorldInfo(3, 4, 1, "10.0.0.2", 1234, "torchrun env")


def test_torchrun_env_missing_master_is_an_error():
    with pytest.raises(WorldDiscoveryError, match="MASTER_ADDR and MASTER_PORT not"):
        discover_world({"RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    "env, local",
    [
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, 0),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, 1),
        ({"PMIX_RANK": "1", "PMIX_SIZE": "2"}, 1),
    ],
    ids=["openmpi", "mpich", "pmix"],
)
def test_mpi_env(env, local):
    info = discover_world(env)
    assert (info.rank, info.world_size, info.local_rank, info.source) == (1, 2, local, "MPI")
    assert info.master_addr is None and info.master_port is None  # agreed later, over MPI


def test_mpi_env_ignored_without_auto_mpi_discovery():
    info = discover_world({"PMI_RANK": "1", "PMI_SIZE": "2"}, auto_mpi_discovery=False)
    assert info.source == "default (single process)" and info.world_size == 1


def test_slurm_env_with_launch_node_ip():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3",
    }
    assert discover_world(env, distributed_port=29600) == WorldInfo(5, 8, 1, "10.1.2.3", 29600, "Slurm")


def test_slurm_env_nodelist_and_master_port(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)  # no scontrol on this machine anyway
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1",
        "MASTER_PORT": "4000",
    }
    info = discover_world(env)
    assert (info.master_addr, info.master_port, info.local_rank) == ("gpu07", 4000, 0)


def test_slurm_without_any_master_is_a_clear_error():
    with pytest.raises(WorldDiscoveryError, match="set MASTER_ADDR"):
        discover_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize(
    "nodelist, first",
    [("node1", "node1"), ("node1,node2", "node1"), ("n[3-5]", "n3"), ("rack[001-004]-x,gpu1", "rack001-x")],
)
def test_first_slurm_host_parser(monkeypatch, nodelist, first):
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert first_slurm_host(nodelist) == first


def test_first_slurm_host_uses_scontrol(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho hostA\necho hostB\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert first_slurm_host("weird{syntax}") == "hostA"


def test_torchrun_env_wins_over_slurm_and_mpi():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "a",
        "MASTER_PORT": "1",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "PMI_RANK": "0",
        "PMI_SIZE": "1",
    }
    assert discover_world(env).source == "torchrun env"


def test_explicit_and_default():
    info = discover_world({}, rank=1, world_size=3, distributed_port=2222)
    assert info == WorldInfo(1, 3, 1, "127.0.0.1", 2222, "explicit")
    assert discover_world({}) == WorldInfo(0, 1, 0, "127.0.0.1", None, "default (single process)")


@pytest.mark.parametrize(
    "env, kwargs, match",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, {}, "RANK='x' is not an integer"),
        (
            {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
            {},
            r"rank 2 is outside \[0, 2\)",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "70000"},
            {},
            "not a valid TCP port",
        ),
        ({}, {"rank": 0}, "give both rank"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, {}, "world size must be >= 1"),
    ],
)
def test_bad_world_env(env, kwargs, match):
    with pytest.raises(WorldDiscoveryError, match=match):
        discover_world(env, **kwargs)


# ---- agreement over MPI (fake communicator) -------------------------------------------


class _FakeComm:
    def __init__(self, rank, size, hosts, proposal_from_root):
        self.rank, self.size, self.hosts, self.root_value = rank, size, hosts, proposal_from_root

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def allgather(self, value):
        return list(self.hosts)

    def bcast(self, value, root=0):
        return value if self.rank == root else self.root_value


def _install_fake_mpi(monkeypatch, comm):
    pkg = types.ModuleType("mpi4py")
    pkg.MPI = types.SimpleNamespace(COMM_WORLD=comm)
    monkeypatch.setitem(sys.modules, "mpi4py", pkg)


def test_mpi_agreement_root_proposes_loopback_and_free_port(monkeypatch):
    host = socket.gethostname()
    _install_fake_mpi(monkeypatch, _FakeComm(0, 2, [host, host], None))
    info = mpi_mod.agree_over_mpi(discover_world({"PMI_RANK": "0", "PMI_SIZE": "2"}), {})
    assert info.master_addr == "127.0.0.1" and 0 < info.master_port < 65536 and info.source == "MPI"


def test_mpi_agreement_non_root_takes_broadcast_and_local_rank_by_host(monkeypatch):
    _install_fake_mpi(monkeypatch, _FakeComm(3, 4, ["a", "a", "b", "b"], ("10.0.0.1", 5555)))
    info = mpi_mod.agree_over_mpi(discover_world({"PMIX_RANK": "3", "PMIX_SIZE": "4"}), {})
    assert (info.master_addr, info.master_port, info.local_rank) == ("10.0.0.1", 5555, 1)


def test_mpi_agreement_rank_mismatch(monkeypatch):
    _install_fake_mpi(monkeypatch, _FakeComm(0, 1, ["a"], None))
    with pytest.raises(WorldDiscoveryError, match="mpi4py says rank 0 of 1"):
        mpi_mod.agree_over_mpi(discover_world({"PMI_RANK": "1", "PMI_SIZE": "2"}), {})


def test_mpi_without_mpi4py_needs_master_port(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` raise ImportError
    with pytest.raises(WorldDiscoveryError, match="pip install mpi4py mpich"):
        mpi_mod.agree_over_mpi(discover_world({"PMI_RANK": "0", "PMI_SIZE": "2"}), {})
    info = mpi_mod.agree_over_mpi(
        discover_world({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_PORT": "7000"}), {}
    )
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 7000)


# ---- real initialisation in this process ----------------------------------------------


def test_single_process_default(clean_env):
    init_distributed(verbose=False)
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    info = world_info()
    assert (info.rank, info.world_size, info.source) == (0, 1, "default (single process)")
    assert os.environ["RANK"] == "0" and os.environ["MASTER_PORT"] == str(info.master_port)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    init_distributed()  # already initialised: a no-op
    assert world_info() == info


def test_explicit_rank_and_world_size_with_tcp_init_method(clean_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}", verbose=False)
    assert world_info().source == "explicit" and dist.get_world_size() == 1


def test_dist_init_required_false_skips(clean_env):
    init_distributed(dist_init_required=False)
    assert not dist.is_initialized()


def test_config_comms_logger_section_is_applied(clean_env):
    from zero_core.comm import comms_logger

    init_distributed(dist_init_required=False, config={"comms_logger": {"enabled": True, "prof_all": True}})
    try:
        assert comms_logger.enabled
    finally:
        comms_logger.configure({"enabled": False})


def test_world_that_cannot_form_fails_clearly(clean_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from zero_core.comm import watchdog

    bound_before = watchdog.collective_timeout()
    start = time.monotonic()
    with pytest.raises(DistributedInitError) as info:
        init_distributed(
            rank=0, world_size=2, distributed_port=port, timeout=timedelta(seconds=3), verbose=False
        )
    assert time.monotonic() - start < 20
    # the 3 s bound belonged to a group that never formed: later groups of the process keep theirs
    assert watchdog.collective_timeout() == bound_before
    msg = str(info.value)
    assert "rank 0 of world size 2" in msg
    assert f"127.0.0.1:{port}" in msg
    assert "from explicit" in msg
    assert "did not form" in msg
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"distributed_port": 0}, ValueError, "distributed_port must be an int in 1..65535"),
        ({"timeout": 5}, ValueError, "timeout must be a positive datetime.timedelta"),
        ({"init_method": "localhost:1"}, ValueError, "init_method must be None or a URL"),
        ({"dist_init_required": "yes"}, TypeError, "dist_init_required must be None, True or False"),
        ({"rank": 1.0}, TypeError, "rank must be an int"),
        ({"dist_backend": "nosuch"}, ValueError, "backend 'nosuch' is not available"),
    ],
)
def test_invalid_arguments(clean_env, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        init_distributed(**kwargs)


# ---- inside an existing world ---------------------------------------------------------


def _init_inside_harness():
    init_distributed(verbose=False)  # the harness already initialised the group: no-op
    info = world_info()
    return info.rank, info.world_size, info.source


def test_already_initialised_is_a_noop():
    assert run_multirank(_init_inside_harness, 2) == [(0, 2, "torchrun env"), (1, 2, "torchrun env")]


# ---- a real mpiexec job ---------------------------------------------------------------

MPI_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from zero_core.distributed import init_distributed, world_info
    init_distributed(auto_mpi_discovery=True, verbose=False)
    info = world_info()
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    out = {"rank": info.rank, "world": info.world_size, "source": info.source, "sum": t.item(),
           "addr": info.master_addr, "port": info.master_port}
    with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()  # nobody tears down (rank 0 hosts the store) while a peer still uses the group
    dist.destroy_process_group()
    """
)


def test_mpiexec_job(tmp_path):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    assert mpiexec.is_file(), "the dev venv must have mpich (pip install mpich mpi4py)"
    script = tmp_path / "job.py"
    script.write_text(MPI_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in WORLD_VARS}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [str(mpiexec), "-n", "2", sys.executable, str(script), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, o in enumerate(outs):
        assert (o["rank"], o["world"], o["source"], o["sum"]) == (r, 2, "MPI", 3.0)
    assert outs[0]["port"] == outs[1]["port"] and outs[0]["addr"] == outs[1]["addr"] == "127.0.0.1"


# ---- the device of the local rank --------------------------------------------------------


class _RecordingGpuAccelerator(zero_accelerator.CpuAccelerator):
    """A CPU accelerator that presents itself as a GPU one and records ``set_device``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def device_name(self, index=None):
        return "cuda" if index is None else f"cuda:{index}"

    def set_device(self, index):
        self.calls.append(("set_device", index))


class _StopBeforeForming(Exception):
    pass


def test_init_distributed_sets_the_device_of_the_local_rank(clean_env):
    """On a GPU accelerator, rank 3 of a node binds to device 3 (LOCAL_RANK) before the group
    forms (NCCL needs it then); nothing would otherwise move it off device 0."""
    fake = _RecordingGpuAccelerator()
    clean_env.setattr(zero_accelerator, "get_accelerator", lambda: fake)

    def fake_init_process_group(backend, **kwargs):
        fake.calls.append(("init_process_group", backend))
        raise _StopBeforeForming

    clean_env.setattr(dist, "init_process_group", fake_init_process_group)
    clean_env.setenv("RANK", "7")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "3")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", "29999")
    with pytest.raises(_StopBeforeForming):
        init_distributed(dist_backend="gloo", verbose=False)
    assert fake.calls == [("set_device", 3), ("init_process_group", "gloo")]


def test_init_distributed_leaves_a_cpu_accelerator_alone(clean_env):
    calls = []
    cpu = zero_accelerator.CpuAccelerator()
    clean_env.setattr(cpu, "set_device", lambda index: calls.append(index))
    clean_env.setattr(zero_accelerator, "get_accelerator", lambda: cpu)
    init_distributed(rank=0, world_size=1, verbose=False)
    assert dist.get_backend() == "gloo" and calls == []


def test_default_backend_follows_the_accelerator(monkeypatch):
    gpu = _RecordingGpuAccelerator()
    monkeypatch.setattr(gpu, "communication_backend_name", lambda: "nccl")
    monkeypatch.setattr(zero_accelerator, "get_accelerator", lambda: gpu)
    assert default_backend() == "nccl"
    monkeypatch.setattr(zero_accelerator, "get_accelerator", lambda: zero_accelerator.CpuAccelerator())
    assert default_backend() == "gloo"


def test_initialize_that_initialises_sets_the_device_too(clean_env):
    """``zero_core.initialize`` forms the group through init_distributed: the same binding."""
    import zero_core

    fake = _RecordingGpuAccelerator()
    clean_env.setattr(zero_accelerator, "get_accelerator", lambda: fake)

    def fake_init_process_group(backend, **kwargs):
        fake.calls.append(("init_process_group", backend))
        raise _StopBeforeForming

    clean_env.setattr(dist, "init_process_group", fake_init_process_group)
    clean_env.setattr(fake, "communication_backend_name", lambda: "gloo")
    for var, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        clean_env.setenv(var, value)
    clean_env.setenv("MASTER_PORT", "29998")
    with pytest.raises(_StopBeforeForming):
        zero_core.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1})
    assert fake.calls == [("set_device", 1), ("init_process_group", "gloo")]
