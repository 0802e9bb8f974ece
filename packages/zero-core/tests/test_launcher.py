"""The ``zero`` console script: ``zero run`` through torchrun and mpiexec, ``zero env``, help."""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from zero_core.launcher import cli
from zero_core.launcher.run import (
    LaunchError,
    add_run_arguments,
    find_mpiexec,
    mpiexec_command,
    torchrun_argv,
)

BIN = Path(sys.executable).parent
JOB = textwrap.dedent(
    """
    import argparse, json, os, sys
    import torch, torch.distributed as dist
    from zero_core.distributed import init_distributed, world_info
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--local_rank", type=int, default=-1)  # a DeepSpeed script's habit
    cli = parser.parse_args()
    init_distributed(verbose=False)
    info = world_info()
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    out = {"rank": info.rank, "world": info.world_size, "source": info.source, "sum": t.item(),
           "omp": os.environ.get("OMP_NUM_THREADS"), "args": sys.argv[1:], "local_rank": cli.local_rank,
           "script": os.path.basename(sys.argv[0])}
    with open(os.path.join(cli.out, f"rank{info.rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    """
)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _run_zero(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run(
        [str(BIN / "zero"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    "launch, source, local_rank_arg, module",
    [
        (["run", "--nproc", "2"], "torchrun env", True, False),
        (["run", "--launcher", "mpi", "-n", "2"], "MPI", True, False),
        (["run", "--nproc", "2", "--no_local_rank"], "torchrun env", False, False),
        (["run", "--nproc", "2", "-m"], "torchrun env", True, True),
        (["run", "--launcher", "mpi", "-n", "2", "--no-local-rank", "-m"], "MPI", False, True),
    ],
    ids=["torchrun", "mpiexec", "torchrun-no-local-rank", "torchrun-module", "mpiexec-module-no-local-rank"],
)
def test_zero_run_two_ranks(tmp_path, launch, source, local_rank_arg, module):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    target = "job" if module else str(script)
    proc = _run_zero([*launch, target, str(tmp_path), "--lr", "0.5"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        # As DeepSpeed's launcher: --local_rank=N before the script's own arguments.
        args = [f"--local_rank={r}"] if local_rank_arg else []
        assert out == {
            "rank": r,
            "world": 2,
            "source": source,
            "sum": 3.0,
            "omp": "1",
            "args": [*args, str(tmp_path), "--lr", "0.5"],
            "local_rank": r if local_rank_arg else -1,
            "script": "job.py",
        }


def test_zero_run_failing_script_exits_nonzero(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("raise SystemExit(3)\n")
    proc = _run_zero(["run", "--nproc", "1", str(script)], tmp_path)
    assert proc.returncode != 0
    assert "failed" in proc.stderr


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return parser.parse_args(argv)


def test_torchrun_argv_single_node_is_standalone(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    argv = torchrun_argv(_parse(["--nproc", "3", str(script), "--x", "1"]))
    shim = ["--module", "zero_core.launcher.local_rank_arg"]
    assert argv == ["--nproc-per-node", "3", "--standalone", *shim, str(script), "--x", "1"]
    argv = torchrun_argv(_parse(["--nproc", "3", "--no_local_rank", str(script), "--x", "1"]))
    assert argv == [
        "--nproc-per-node",
        "3",
        "--standalone",
        *shim,
        "--no-local-rank",
        str(script),
        "--x",
        "1",
    ]
    argv = torchrun_argv(_parse(["--nproc", "3", "-m", "pkg.train", "--x", "1"]))
    assert argv == ["--nproc-per-node", "3", "--standalone", *shim, "--module", "pkg.train", "--x", "1"]
    argv = torchrun_argv(_parse(["--no-local-rank", "-m", "pkg.train"]))
    assert argv == [
        "--nproc-per-node",
        "1",
        "--standalone",
        *shim,
        "--no-local-rank",
        "--module",
        "pkg.train",
    ]


def test_torchrun_argv_multi_node_flags(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    ours = (
        "--nproc_per_node 8 --nnodes 2 --node_rank 1 --master_addr node0 --master-port 29600 "
        "--rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job7 --max-restarts 2"
    )
    # torchrun's spellings: underscores become dashes, dashed flags pass through
    theirs = (
        "--nproc-per-node 8 --nnodes 2 --node-rank 1 --master-addr node0 --master-port 29600 "
        "--rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job7 --max-restarts 2"
    )
    argv = torchrun_argv(_parse([*ours.split(), "--no_local_rank", str(script)]))
    shim = ["--module", "zero_core.launcher.local_rank_arg", "--no-local-rank"]
    assert argv == [*theirs.split(), *shim, str(script)]


def test_mpiexec_command(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    env: dict[str, str] = {}
    cmd = mpiexec_command(_parse(["--launcher", "mpi", "-n", "4", "--mpi-args=-v", str(script), "a"]), env)
    assert cmd[:3] == [str(BIN / "mpiexec"), "-n", "4"]
    assert cmd[3:6] == ["-genv", "OMP_NUM_THREADS", "1"]  # the venv's mpiexec is MPICH's hydra
    assert cmd[6:] == ["-v", sys.executable, "-m", "zero_core.launcher.local_rank_arg", str(script), "a"]
    cmd = mpiexec_command(_parse(["--launcher", "mpi", "--no_local_rank", "-m", "pkg.train", "a"]), env)
    shim = [sys.executable, "-m", "zero_core.launcher.local_rank_arg", "--no-local-rank"]
    assert cmd[-7:] == [*shim, "--module", "pkg.train", "a"]
    assert env["OMP_NUM_THREADS"] == "1"
    env = {"OMP_NUM_THREADS": "2"}
    mpiexec_command(_parse(["--launcher", "mpi", str(script)]), env)
    assert env["OMP_NUM_THREADS"] == "2"  # a user's choice is kept


def test_mpi_launcher_rejects_torchrun_flags(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(LaunchError, match="--nnodes.*torchrun options"):
        mpiexec_command(_parse(["--launcher", "mpi", "--nnodes", "2", str(script)]), {})


def test_missing_mpiexec_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="pip install mpich mpi4py"):
        find_mpiexec()


def test_missing_script_and_bad_nproc(tmp_path, capsys):
    assert cli.main(["run", "--nproc", "2", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    script = tmp_path / "t.py"
    script.write_text("")
    assert cli.main(["run", "--nproc", "0", str(script)]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err


def test_env_report_text(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    import torch

    assert f"torch ......................... {torch.__version__}" in out
    assert "zero-core ....................." in out
    assert "backend gloo .................. available" in out
    assert "communication_backend ......... gloo" in out
    assert "mpi4py" in out and "mpiexec" in out and "MPICH" in out


def test_env_report_json_lists_native_ops(capsys, monkeypatch):
    fake = types.ModuleType("zero_ops")
    fake.__spec__ = importlib.machinery.ModuleSpec("zero_ops", None)
    fake.op_report = lambda: [
        {"name": "cpu_adam", "status": "compiled", "isa": "avx512", "reason": ""},
        {"name": "cpu_lion", "status": "fallback", "isa": "", "reason": "no compiler"},
    ]
    monkeypatch.setitem(sys.modules, "zero_ops", fake)
    assert cli.main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["native_ops"]["ops"][0] == {
        "name": "cpu_adam",
        "status": "compiled",
        "isa": "avx512",
        "reason": "",
    }
    assert report["distributed_backends"]["gloo"] is True
    assert "zero-core" in report["zero_family"]
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "cpu_adam ......................" in out and "compiled (isa=avx512)" in out
    assert "fallback (reason=no compiler)" in out


def test_env_report_without_zero_ops(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "zero_ops", None)
    monkeypatch.setattr("zero_core.launcher.env_report.is_available", lambda name: False)
    assert cli.main(["env"]) == 0
    assert "zero-ops not installed" in capsys.readouterr().out


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "run" in out and "env" in out and "zero run --launcher mpi -n 4 train.py" in out
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--nproc",
        "--launcher",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--rdzv-endpoint",
        "--standalone",
        "--max-restarts",
        "--mpi-args",
    ):
        assert flag in out
    assert cli.main([]) == 2  # no command: help and a usage error code


def test_local_rank_shim_usage_and_argv(tmp_path, monkeypatch):
    from zero_core.launcher import local_rank_arg

    with pytest.raises(SystemExit, match="usage: python -m zero_core.launcher.local_rank_arg"):
        local_rank_arg.main([])
    with pytest.raises(SystemExit, match="usage"):
        local_rank_arg.main(["--module"])
    assert local_rank_arg.script_argv("t.py", ["--x", "1"], 3) == ["t.py", "--local_rank=3", "--x", "1"]
    # In-process: the script sees DeepSpeed's argv and its own directory first on sys.path.
    script = tmp_path / "probe.py"
    script.write_text("")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    seen = {}
    monkeypatch.setattr(
        local_rank_arg.runpy,
        "run_path",
        lambda path, run_name: seen.update(argv=list(sys.argv), path0=sys.path[0]),
    )
    local_rank_arg.main([str(script), "--lr", "1"])
    assert seen == {"argv": [str(script), "--local_rank=1", "--lr", "1"], "path0": str(tmp_path)}


def test_config_file_is_checked_before_any_rank_starts(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("raise AssertionError('no rank may start')\n")
    for args in (["--zero_config", "does_not_exist.json"], ["--deepspeed_config=missing.json"]):
        assert cli.main(["run", "--nproc", "2", str(script), *args]) == 2
        err = capsys.readouterr().err
        flag, _, path = args[0].partition("=") if "=" in args[0] else (args[0], "", args[1])
        assert f"{flag} {path!r} (an argument of {script}) is not a file" in err, err
        assert "no process was started" in err and err.count("\n") == 1, err


def test_config_paths_found_in_script_arguments():
    from zero_core.launcher.run import config_paths

    args = ["--zero_config", "a.json", "--deepspeed", "--deepspeed_config=b.json", "--x", "1"]
    assert config_paths(args) == [("--zero_config", "a.json"), ("--deepspeed_config", "b.json")]
    # HF's --deepspeed takes a path; DeepSpeed's is a boolean flag; JSON text is not a path.
    assert config_paths(["--deepspeed", "ds.json", "--zero_config", '{"train_batch_size": 1}']) == [
        ("--deepspeed", "ds.json")
    ]
    assert config_paths(["--deepspeed", "--lr", "1", "--zero_config"]) == []
    # a repeated flag: argparse keeps the last (`hatch run demo --zero_config other.json`)
    assert config_paths(["--zero_config", "a.json", "--zero_config=b.json"]) == [("--zero_config", "b.json")]


def test_rank_error_prints_once_naming_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os\nraise ValueError('bad value ' + 'in train.py')\n")
    proc = _run_zero(["run", "--nproc", "2", str(script)], tmp_path)
    assert proc.returncode == 1
    err = proc.stderr
    assert err.count("ValueError: bad value in train.py") == 1, err  # not once per rank
    assert f'File "{script}", line 2' in err and "runpy" not in err, err  # the user's frames only
    assert f"zero run: {script} failed on rank" in err, err
    assert "local_rank_arg" not in err and "OMP_NUM_THREADS" not in err, err  # no shim, no banner
    assert len(err.strip().splitlines()) <= 6, err


def test_env_report_cuda_devices_nccl_and_compute_capability(capsys, monkeypatch):
    """With GPUs, ``zero env`` names each device with its compute capability and the NCCL version
    (faked here: the CPU build has neither); without, it says so."""
    import torch

    assert cli.main(["env", "--json"]) == 0
    cuda = json.loads(capsys.readouterr().out)["cuda_devices"]
    assert cuda["available"] is torch.cuda.is_available()
    assert cuda["device_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0) if i == 0 else (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Fake GPU {i}")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert cli.main(["env", "--json"]) == 0
    cuda = json.loads(capsys.readouterr().out)["cuda_devices"]
    assert cuda["device_count"] == 2 and cuda["nccl_version"] == "2.21.5"
    assert cuda["devices"][1] == {"index": 1, "name": "Fake GPU 1", "compute_capability": "8.6"}
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "NCCL version ..." in out and "2.21.5" in out
    assert "cuda:0" in out and "Fake GPU 0 (compute capability 9.0)" in out
