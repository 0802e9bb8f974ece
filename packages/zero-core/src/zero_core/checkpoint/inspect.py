"""``tools/inspect_checkpoint.py``: what a checkpoint holds, with every checksum verified.

Engine checkpoints of every kind (zero-pipe's too, with their pipeline layout), and the module-only
directories of zero-pipe and zero-moe (see [Note: module-only checkpoint directories] in
``module_dirs.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

from zero_core.checkpoint.format import COMMIT_FILE, LATEST_FILE, CheckpointError
from zero_core.checkpoint.fragments import FP32, PARAM
from zero_core.checkpoint.loader import open_checkpoint
from zero_core.checkpoint.module_dirs import PIPE_INDEX, ModuleFiles, open_module_dir


def describe(checkpoint_dir: str) -> str:
    """A report of every complete tag under ``checkpoint_dir``; raises CheckpointError on a bad file.

    ``checkpoint_dir`` may also be one tag directory (as ``zero_to_fp32`` takes it); a directory
    holding no tag is an error rather than an empty report.
    """
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a directory")
    module_dir = open_module_dir(checkpoint_dir)
    if module_dir is not None:  # see [Note: module-only checkpoint directories] in module_dirs.py
        return _describe_module_dir(module_dir)
    if os.path.isfile(os.path.join(checkpoint_dir, COMMIT_FILE)):  # one tag directory
        checkpoint_dir, only = os.path.split(os.path.abspath(checkpoint_dir))
        tags = [only]
    else:
        tags = sorted(
            t
            for t in os.listdir(checkpoint_dir)
            if os.path.isfile(os.path.join(checkpoint_dir, t, COMMIT_FILE))
        )
    if not tags:
        raise CheckpointError(
            f"{checkpoint_dir} holds no checkpoint: no <tag>/{COMMIT_FILE} in it (pass the save_dir given to "
            "save_checkpoint, or one of its tag directories)"
        )
    latest = None
    if os.path.isfile(os.path.join(checkpoint_dir, LATEST_FILE)):
        latest = open(os.path.join(checkpoint_dir, LATEST_FILE)).read().strip()
    lines = [f"checkpoint dir: {checkpoint_dir}", f"latest: {latest}", f"tags: {tags}"]
    for tag in tags:
        meta, reader = open_checkpoint(checkpoint_dir, tag)
        try:
            names = sorted(set(reader.names(PARAM)) | set(reader.names(FP32)))
            count = sum(_numel(reader.shape(n, FP32 if reader.has(n, FP32) else PARAM)) for n in names)
            dtypes = sorted(
                {str(reader.dtype(n, PARAM)) for n in names if reader.has(n, PARAM)}
                | ({"torch.float32 (master)"} if any(reader.has(n, FP32) for n in names) else set())
            )
            lines += [
                f"[{tag}] world_size {meta['world_size']} | zero stage {meta['zero_stage']} | "
                f"compute dtype {meta['compute_dtype']} | step {meta['global_steps']} | "
                f"parameters {count:,} in {len(names)} tensors | dtypes {dtypes}"
            ]
            lines += _pipeline_lines(meta)
            for r in range(reader.world_size):
                reader.tensor_file(r)  # verifies the checksum (crc32c; sum64 or crc32 in old checkpoints)
                rec = reader.rank_table(r)["file_record"]
                digest = _digest(rec)
                lines.append(f"    {reader.rank_table(r)['file']}: {rec['bytes']:,} bytes, {digest} OK")
        finally:
            reader.close()
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _pipeline_lines(meta: dict) -> list[str]:
    """The layout of a zero-pipe engine checkpoint (see [Note: universal pipeline checkpoints] in zero-pipe)."""
    p = meta.get("pipeline")
    if not isinstance(p, dict):
        return []
    lines = [
        f"    pipeline: {_plural(p.get('num_stages', 0), 'stage')} x {_plural(p.get('num_chunks', 0), 'chunk')}, "
        f"{_plural(p.get('data_parallel_size', 0), 'data-parallel replica')}, ZeRO stage {meta['zero_stage']}, "
        f"{_plural(p.get('num_layers', 0), 'layer')} (stage boundaries {p.get('parts')}; loads in any layout)"
    ]
    tied = p.get("tied_owner_stages") or {}
    if tied:
        lines.append(
            "    tied: "
            + ", ".join(f"{k} (stages {', '.join(map(str, v))})" for k, v in sorted(tied.items()))
        )
    return lines


def _describe_module_dir(ckpt: ModuleFiles) -> str:
    """A zero-pipe layer directory or zero-moe expert directory: what it holds, every file verified."""
    try:
        meta = ckpt.meta
        names = sorted({n for n, _ in ckpt.index})
        count = sum(_numel(tuple(e["rec"]["shape"])) for e in ckpt.index.values())
        dtypes = sorted({e["rec"]["dtype"] for e in ckpt.index.values()})
        if ckpt.layout == PIPE_INDEX:
            what = (
                f"zero-pipe module layers (save_state_dict) | {_plural(meta['num_layers'], 'layer')} | saved at "
                f"{_plural(meta.get('saved_num_stages', 0), 'stage')}"
                + (
                    " | a format-2 engine checkpoint (optimizer states in its own layout)"
                    if "engine" in meta
                    else ""
                )
            )
        else:
            layers = meta.get("layers", [])
            what = "zero-moe experts (save_moe_checkpoint) | " + ", ".join(
                f"{entry.get('module') or '<model>'}: {entry.get('num_experts')} experts" for entry in layers
            )
        lines = [
            f"checkpoint dir: {ckpt.tag_dir}",
            what,
            f"tensors {count:,} elements in {len(names)} tensors | dtypes {dtypes}",
        ]
        for r, table in enumerate(ckpt.tables):
            ckpt._file(r)  # verified when opened
            rec = table["file_record"]
            lines.append(f"    {table['file']}: {rec['bytes']:,} bytes, {_digest(rec)} OK")
        return "\n".join(lines)
    finally:
        ckpt.close()


def _digest(rec: dict) -> str:
    if "crc32c" in rec:
        crcs = rec["crc32c"]
        return f"crc32c {crcs[0]:#010x}" + (f" (+{len(crcs) - 1} more pieces)" if len(crcs) > 1 else "")
    return f"sum64 {rec['sum64']}" if "sum64" in rec else f"crc32 {rec['crc32']:#010x}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Describe a zero checkpoint and verify its checksums.")
    parser.add_argument("checkpoint_dir", help="the save_dir given to save_checkpoint, or one tag directory")
    args = parser.parse_args(argv)
    try:
        print(describe(args.checkpoint_dir))
    except CheckpointError as e:
        print(f"inspect_checkpoint: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
