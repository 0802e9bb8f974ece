"""``zero-estimate``: memory needs of a model for every ZeRO stage and offload option.

zero-estimate --params 7e9 --gpus 8 --nodes 1
zero-estimate --model-config config.json --gpus 8 --seq-len 2048 --micro-batch 1
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from zero_profiler.memory_estimators import (
    GIB,
    format_table,
    zero2_rows,
    zero3_rows,
    zero_paper_model_states_bytes,
)
from zero_profiler.transformer_estimates import estimate_transformer_activation_mem, shape_from_hf_config

_STAGE_NAMES = ["0 (DDP)", "1 (optimizer states)", "2 (+ gradients)", "3 (+ parameters)"]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 7e9, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zero-estimate", description="Estimate ZeRO model-state (and activation) memory per CPU and GPU."
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_positive_float, help="total parameters, e.g. 7e9")
    src.add_argument("--model-config", help="a Hugging Face config.json to derive the parameter count from")
    p.add_argument(
        "--largest-layer-params", type=_positive_float, help="parameters of the largest layer (ZeRO-3)"
    )
    p.add_argument("--gpus", type=_positive_int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--nodes", type=_positive_int, default=1, help="nodes (default 1)")
    p.add_argument(
        "--buffer-factor", type=_positive_float, default=1.5, help="additional_buffer_factor (default 1.5)"
    )
    p.add_argument("--seq-len", type=_positive_int, help="sequence length for the activation estimate")
    p.add_argument("--micro-batch", type=_positive_int, default=1, help="micro-batch per GPU (default 1)")
    p.add_argument(
        "--tensor-parallel", type=_positive_int, default=1, help="tensor-parallel degree (default 1)"
    )
    p.add_argument("--flash-attention", action="store_true", help="attention keeps no s^2 score matrix")
    p.add_argument("--no-dropout", action="store_true", help="the model has no dropout")
    p.add_argument("--activation-checkpointing", action="store_true", help="full activation checkpointing")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of tables")
    return p


def estimate(args: argparse.Namespace) -> dict:
    """Every number the command reports, as data."""
    shape = None
    if args.model_config is not None:
        shape = shape_from_hf_config(args.model_config)
        total = float(shape.total_params())
        largest = float(args.largest_layer_params or shape.largest_layer_params())
    else:
        total = args.params
        largest = args.largest_layer_params
    if args.buffer_factor < 1:
        raise ValueError(f"--buffer-factor must be >= 1, got {args.buffer_factor}")
    if largest is not None and largest > total:
        raise ValueError(f"--largest-layer-params ({largest:g}) exceeds the total parameters ({total:g})")
    devices = args.gpus * args.nodes
    out: dict = {
        "total_params": total,
        "largest_layer_params": largest,
        "gpus_per_node": args.gpus,
        "nodes": args.nodes,
        "zero_paper_bytes_per_device": {
            stage: zero_paper_model_states_bytes(total, devices, stage) for stage in range(4)
        },
        "zero2": [r.__dict__ for r in zero2_rows(total, args.gpus, args.nodes, args.buffer_factor)],
        "zero3": None,
        "activation_bytes_per_gpu": None,
    }
    if largest is not None:
        out["zero3"] = [
            r.__dict__ for r in zero3_rows(total, largest, args.gpus, args.nodes, args.buffer_factor)
        ]
    if args.seq_len is not None:
        if shape is None:
            raise ValueError(
                "--seq-len needs --model-config (the activation estimate needs the model's shapes)"
            )
        out["activation_bytes_per_gpu"] = estimate_transformer_activation_mem(
            shape.hidden_size,
            shape.num_layers,
            shape.num_attention_heads,
            args.seq_len,
            args.micro_batch,
            tensor_parallel_size=args.tensor_parallel,
            dropout=not args.no_dropout,
            flash_attention=args.flash_attention,
            activation_checkpointing=args.activation_checkpointing,
        )
    return out


def render(data: dict) -> str:
    from zero_profiler.memory_estimators import MemoryEstimate, _header

    total, largest = data["total_params"], data["largest_layer_params"]
    gpus, nodes = data["gpus_per_node"], data["nodes"]
    lines = [
        f"Model states per device, mixed-precision Adam (ZeRO paper), {gpus * nodes} devices:",
        f"{'stage':<22} | per device",
    ]
    for stage, name in enumerate(_STAGE_NAMES):
        lines.append(f"{name:<22} | {data['zero_paper_bytes_per_device'][stage] / 1e9:8.2f} GB (1e9 bytes)")
    lines += ["", "ZeRO-2:"]
    lines.append(
        format_table([MemoryEstimate(**r) for r in data["zero2"]], _header(total, gpus, nodes, None))
    )
    lines += ["", "ZeRO-3:"]
    if data["zero3"] is None:
        lines.append("(needs --largest-layer-params, or --model-config to derive it)")
    else:
        lines.append(
            format_table([MemoryEstimate(**r) for r in data["zero3"]], _header(total, gpus, nodes, largest))
        )
    if data["activation_bytes_per_gpu"] is not None:
        lines += [
            "",
            f"Activations per GPU (16-bit, kept for backward): {data['activation_bytes_per_gpu'] / GIB:.2f}GB",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        data = estimate(args)
    except (ValueError, OSError, TypeError) as err:
        parser.error(str(err))
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
