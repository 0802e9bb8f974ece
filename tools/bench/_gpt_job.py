"""One rank of a short training job on the examples/ GPT under zero, DeepSpeed or FSDP2.

The memory and speed benchmarks of ZeRO-Infinity (bench_max_model, bench_infinity_speed) launch
this file once per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the
environment, as torchrun sets them) with the interpreter of the system under test: the project's
Python for zero and FSDP2, DeepSpeed's own venv for DeepSpeed. So this module needs only the
standard library and torch at import time; each system's package is imported inside its builder.

[Note: one config for every system]
zero and DeepSpeed read the same DeepSpeed JSON config (:func:`ds_config`): fp32 training,
Adam, the ZeRO stage and the offload sections of the mode. Stage 3 knobs that otherwise scale
with DeepSpeed's defaults (50M-element prefetch buckets, 1e9 live parameters, 1e9-element
optimizer sub-groups) are set to a block or a few (the prefetch bucket to one 4w x w matrix),
so the memory a mode needs is its model states plus a few blocks' worth of buffers, as a user
sizing a large model would set them.
Stage 3 models are built inside the system's ``zero.Init`` (``remote_device`` cpu / nvme for the
offload modes), so construction is partitioned too. FSDP2 builds the model on the meta device,
shards every block and the root with ``fully_shard`` (plus ``CPUOffloadPolicy`` in its offload
mode), then materialises and initialises the shards: its equivalent of ``zero.Init``.

Each rank prints one ``RESULT {json}`` line: construction and initialisation seconds, per step
wall time and its forward / backward / step phases, losses, the bytes this process read from and
wrote to storage per step (``/proc/self/io``: block-layer bytes, so swapping with O_DIRECT counts
and page-cache hits do not), and its peak RSS (``VmHWM``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # the GPT (gpt.py needs only torch)

#: the modes zero and DeepSpeed run, and what each offloads
ZERO_MODES = (
    "stage0",
    "stage1",
    "stage2",
    "stage3",
    "stage3+opt-cpu",
    "stage3+opt-cpu+param-cpu",
    "stage3+nvme",
)
FSDP_MODES = ("fsdp2", "fsdp2+cpu-offload")
SYSTEMS = {"zero": ZERO_MODES, "deepspeed": ZERO_MODES, "fsdp2": FSDP_MODES}
PARAM_BUFFERS = 8  # offload_param buffer_count: the 4 large matrices of two blocks in flight
OPT_BUFFERS = 4  # offload_optimizer buffer_count


def block_params(width: int) -> int:
    """Parameters of one examples/ GPT block: qkv, proj, fc, out (weights and biases), two LayerNorms."""
    return 12 * width * width + 13 * width


def largest_param(width: int) -> int:
    """Elements of the GPT's largest single parameter (the MLP's 4w x w matrices)."""
    return 4 * width * width


def ds_config(mode: str, width: int, nvme_dir: str | None, micro_batch: int, world: int = 2) -> dict:
    """The DeepSpeed JSON config of ``mode`` for a GPT of ``width``. See [Note: one config for every system]."""
    if mode not in ZERO_MODES:
        raise ValueError(f"ds_config: mode must be one of {ZERO_MODES}, got {mode!r}")
    stage = int(mode[len("stage")])
    zc: dict = {"stage": stage}
    if stage == 3:
        block = block_params(width)
        zc.update(
            sub_group_size=block,
            # one large matrix ahead: with a block, DeepSpeed 0.19.8's NVMe parameter prefetch asserts
            # ("param ... already assigned swap buffer id ...") on the examples/ GPT
            prefetch_bucket_size=largest_param(width),
            max_live_parameters=3 * block,
            max_reuse_distance=block,
        )
    if "opt-cpu" in mode:
        zc["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if "param-cpu" in mode:
        zc["offload_param"] = {"device": "cpu", "pin_memory": False}
    if mode == "stage3+nvme":
        if not nvme_dir:
            raise ValueError("ds_config: stage3+nvme needs an nvme_dir")
        zc["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": nvme_dir,
            "buffer_count": OPT_BUFFERS,
            # DeepSpeed 0.19.8's pipelined optimizer swapper runs out of swap buffers with few of
            # them (see bench_offload); both systems run the same unpipelined config
            "pipeline_read": False,
            "pipeline_write": False,
        }
        zc["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme_dir,
            "buffer_count": PARAM_BUFFERS,
            "buffer_size": largest_param(width),
            "max_in_cpu": 0,
        }
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": zc,
    }
    if mode == "stage3+nvme":
        cfg["aio"] = {
            "block_size": 1048576,
            "queue_depth": 8,
            "thread_count": 2,
            "single_submit": False,
            "overlap_events": True,
        }
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(
    system: str,
    mode: str,
    layers: int,
    width: int,
    seq_len: int,
    micro_batch: int,
    world: int,
    nvme: str | None,
    ds_python: str,
    steps: int = 2,
) -> tuple[list[list[str]], list[dict[str, str]]]:
    """Per-rank commands and environments of one job of this file (torchrun's variables, set by hand)."""
    python = ds_python if system == "deepspeed" else sys.executable
    cmd = [python, os.path.abspath(__file__), "--system", system, "--mode", mode, "--layers", str(layers)]
    cmd += ["--width", str(width), "--seq-len", str(seq_len), "--micro-batch", str(micro_batch)]
    cmd += ["--steps", str(steps)] + (["--nvme", nvme] if nvme else [])
    base = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if system == "deepspeed":
        base["DS_ACCELERATOR"] = "cpu"
        base.pop("PYTHONPATH", None)  # DeepSpeed's venv: nothing of this repository but examples/
    envs = [dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world)) for r in range(world)]
    return [cmd] * world, envs


def _gpt_config(args: argparse.Namespace):
    from gpt import GPTConfig

    return GPTConfig(
        seq_len=args.seq_len, d_model=args.width, n_layers=args.layers, n_heads=max(1, args.width // 64)
    )


def _build_ds_family(system: str, args: argparse.Namespace, cfg: dict):
    """zero or DeepSpeed: (engine, seconds to build the model, seconds to initialise the engine)."""
    from gpt import GPT

    lib = __import__(system)
    lib.init_distributed(dist_backend="gloo", verbose=False)
    t0 = time.perf_counter()
    if args.mode.startswith("stage3"):
        remote = "nvme" if args.mode == "stage3+nvme" else "cpu" if "param-cpu" in args.mode else None
        with lib.zero.Init(config_dict_or_path=cfg, remote_device=remote):
            model = GPT(_gpt_config(args))
    else:
        model = GPT(_gpt_config(args))
    t1 = time.perf_counter()
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, t1 - t0, time.perf_counter() - t1


def _build_fsdp2(args: argparse.Namespace):
    """FSDP2: (train_step, seconds to build and shard the model, seconds to build the optimizer)."""
    import torch
    import torch.distributed as dist
    from gpt import GPT
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if args.mode == "fsdp2+cpu-offload" else {}
    with torch.device("meta"):
        model = GPT(_gpt_config(args))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    model.to_empty(device="cpu")
    model.apply(GPT._init)
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.reset_parameters()
    t1 = time.perf_counter()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt, t1 - t0, time.perf_counter() - t1


def _io_bytes() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process moved through the block layer so far."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key] = int(value)
    except OSError:
        return 0, 0
    return out.get("read_bytes", 0), out.get("write_bytes", 0)


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _batches(args: argparse.Namespace, rank: int, world: int):
    import torch
    from gpt import ByteDataset, stdlib_corpus

    data = ByteDataset(stdlib_corpus(1_000_000), args.seq_len)
    for step in range(args.steps):
        first = ((step * world + rank) * args.micro_batch) % (len(data) - args.micro_batch)
        rows = [data[first + i] for i in range(args.micro_batch)]
        yield torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def _fetch_wait_counter(engine: Any) -> Any:
    """Seconds so far that zero's parameter fetches waited for NVMe reads (zero-offload's
    ``ParamOffload.fetch_wait_s``: the parameter swapping the compute did not hide); 0 elsewhere."""
    strategy = getattr(engine, "strategy", None)
    offloads = strategy.shard_stores() if hasattr(strategy, "shard_stores") else []
    return lambda: float(sum(getattr(po, "fetch_wait_s", 0.0) for po in offloads))


def _train(args: argparse.Namespace, rank: int, world: int) -> dict:
    import torch

    torch.manual_seed(0)
    if args.system == "fsdp2":
        model, opt, build_s, init_s = _build_fsdp2(args)

        def fwd(x, y):
            return model(x, y)

        def bwd(loss):
            loss.backward()

        def stp():
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        cfg = ds_config(args.mode, args.width, args.nvme, args.micro_batch, world)
        engine, build_s, init_s = _build_ds_family(args.system, args, cfg)
        fwd, bwd, stp = engine, engine.backward, engine.step
    waited = _fetch_wait_counter(engine if args.system == "zero" else None)
    steps = []
    for x, y in _batches(args, rank, world):
        r0, w0 = _io_bytes()
        f0 = waited()
        t0 = time.perf_counter()
        loss = fwd(x, y)
        t1 = time.perf_counter()
        bwd(loss)
        t2 = time.perf_counter()
        stp()
        t3 = time.perf_counter()
        r1, w1 = _io_bytes()
        steps.append(
            {
                "wall": t3 - t0,
                "forward": t1 - t0,
                "backward": t2 - t1,
                "step": t3 - t2,
                "loss": float(loss.detach()),
                "read_bytes": r1 - r0,
                "write_bytes": w1 - w0,
                "fetch_wait": waited() - f0,
            }
        )
        print(f"[rank {rank}] step {len(steps)}: {t3 - t0:.2f} s, loss {steps[-1]['loss']:.4f}", flush=True)
    return {"build_s": build_s, "init_s": init_s, "steps": steps}


def _versions(system: str) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if system in ("zero", "deepspeed"):
        out[system] = getattr(__import__(system), "__version__", "?")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one rank of a GPT training job (see the module docstring)")
    ap.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--nvme", default=None, help="folder for the swap files (stage3+nvme)")
    args = ap.parse_args(argv)
    if args.mode not in SYSTEMS[args.system]:
        ap.error(f"--mode {args.mode!r} is not a mode of {args.system}: {SYSTEMS[args.system]}")
    if args.layers < 1 or args.width < 64 or args.width % 64:
        ap.error(f"--layers must be >= 1 and --width a multiple of 64, got {args.layers}, {args.width}")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    t0 = time.perf_counter()
    out = _train(args, rank, world)
    out.update(
        rank=rank,
        world=world,
        system=args.system,
        mode=args.mode,
        layers=args.layers,
        width=args.width,
        total_s=time.perf_counter() - t0,
        peak_rss=peak_rss_bytes(),
        versions=_versions(args.system),
    )
    print("RESULT " + json.dumps(out), flush=True)
    if args.system == "fsdp2":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
