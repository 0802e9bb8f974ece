"""``tools/inspect_checkpoint.py``: what a checkpoint holds, with every checksum verified."""

from __future__ import annotations

import argparse
import os
import sys

from zero_core.checkpoint.format import COMMIT_FILE, LATEST_FILE, CheckpointError
from zero_core.checkpoint.fragments import FP32, PARAM
from zero_core.checkpoint.loader import open_checkpoint


def describe(checkpoint_dir: str) -> str:
    """A report of every complete tag under ``checkpoint_dir``; raises CheckpointError on a bad file.

    ``checkpoint_dir`` may also be one tag directory (as ``zero_to_fp32`` takes it); a directory
    holding no tag is an error rather than an empty report.
    """
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a directory")
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
            for r in range(reader.world_size):
                reader.tensor_file(r)  # verifies the checksum (crc32c; sum64 or crc32 in old checkpoints)
                rec = reader.rank_table(r)["file_record"]
                digest = _digest(rec)
                lines.append(f"    {reader.rank_table(r)['file']}: {rec['bytes']:,} bytes, {digest} OK")
        finally:
            reader.close()
    return "\n".join(lines)


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
