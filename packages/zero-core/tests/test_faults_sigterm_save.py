"""SIGTERM arriving in the middle of ``save_checkpoint`` removes the staging directory.

The process is a real one (a child Python process with a 1-rank gloo group): it saves a good
checkpoint, then starts a second save during which the tensor writer delivers SIGTERM to the
process itself (the fault: the job is ended mid-save, as a scheduler does). Expected: the process
dies by SIGTERM, no ``.<tag>.partial`` staging directory is left behind, ``latest`` still names
the good checkpoint and it loads. See [Note: cleanup on SIGTERM] in zero_core/utils/termination.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import zero_core
    from zero_core.checkpoint import saver

    save_dir = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(save_dir, tag="good")

    real = saver.write_tensor_file
    def killed_mid_write(*args, **kwargs):
        real(*args, **kwargs)  # one file is in the staging directory already
        os.kill(os.getpid(), signal.SIGTERM)
    saver.write_tensor_file = killed_mid_write
    engine.save_checkpoint(save_dir, tag="doomed")
    print("save returned: SIGTERM was not delivered", flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_during_save_leaves_no_staging_directory(tmp_path) -> None:
    save_dir = tmp_path / "ckpt"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(save_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    left = sorted(p.name for p in save_dir.iterdir())
    assert not [n for n in left if n.endswith(".partial")], left
    assert "doomed" not in left and "good" in left, left
    assert (save_dir / "latest").read_text().strip() == "good"
    meta = json.loads((save_dir / "good" / "checkpoint.json").read_text())
    assert meta  # the good checkpoint's root record is intact

    load = textwrap.dedent(
        """
        import sys, torch, zero_core
        model = torch.nn.Linear(8, 4)
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
        engine, *_ = zero_core.initialize(model=model, config=cfg)
        path, _ = engine.load_checkpoint(sys.argv[1])
        assert path is not None and path.rstrip("/").endswith("good"), path
        print("loaded", path)
        """
    )
    env["MASTER_PORT"] = str(_free_port())
    proc = subprocess.run(
        [sys.executable, "-c", load, str(save_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded" in proc.stdout
