"""Peak memory of converting a >= 200M-parameter checkpoint stays far below the output shards.

The checkpoint is written directly in the format (no training): two rank files whose tensor
data are sparse (holes read as zeros, so building it costs no disk or memory) except for a
distinct marker at the start and end of every fragment, which the test finds at the right
place in the output. The conversion runs the script copied into the checkpoint in a fresh
interpreter, as a user would; its peak RSS is read from /proc/self/status (VmHWM).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import torch
from zero_core.checkpoint.format import dumps
from zero_core.checkpoint.integrity import file_checksum, file_record
from zero_core.checkpoint.tensor_file import TensorEntry, _header_bytes

PARAMS = 204_000_000  # fp32: 816 MB of output
TENSORS = 12
SHARD = "210MB"  # the largest output shard is then 3 tensors = 204 MB
MARK = 1024  # elements of marker at each end of every fragment

_MEASURE = (
    "import runpy, sys\n"
    "def kb(key):\n"
    "    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1])\n"
    "base = kb('VmRSS:')\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    if e.code:\n"
    "        raise\n"
    "print('RSS_KB', base, kb('VmHWM:'), 'TORCH', 'torch' in sys.modules)\n"
)


def _marker(tensor: int, rank: int, end: bool) -> torch.Tensor:
    return torch.full((MARK,), float(1000 * tensor + 10 * rank + int(end) + 1))


def _write_synthetic(root: str) -> None:
    """A 2-rank tag ``syn``: fp32 fragments of TENSORS parameters, each split in half between the ranks."""
    tag = os.path.join(root, "syn")
    os.makedirs(tag)
    per = PARAMS // TENSORS
    names = [f"layers.{i}.weight" for i in range(TENSORS)]
    files = {}
    for r in range(2):
        lo, hi = (0, per // 2) if r == 0 else (per // 2, per)
        keys = [f"fp32:{n}:{lo}" for n in names]
        entries = [TensorEntry(k, (hi - lo,), torch.float32, lambda: None) for k in keys]  # header only
        header = _header_bytes(entries, None)
        path = os.path.join(tag, f"rank_{r:05d}.safetensors")
        nbytes = (hi - lo) * 4
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(len(header) + TENSORS * nbytes)  # sparse: no data written
            for i in range(TENSORS):
                base = len(header) + i * nbytes
                f.seek(base)
                f.write(_marker(i, r, False).numpy().tobytes())
                f.seek(base + nbytes - 4 * MARK)
                f.write(_marker(i, r, True).numpy().tobytes())
        frags = [
            {
                "name": n,
                "kind": "fp32",
                "shape": [per],
                "dtype": "float32",
                "start": lo,
                "end": hi,
                "key": k,
                "elementwise": True,
                "python_scalar": False,
            }
            for n, k in zip(names, keys)
        ]
        table = {
            "rank": r,
            "world_size": 2,
            "file": os.path.basename(path),
            "file_record": file_record(*file_checksum(path)),
            "fragments": frags,
            "rng": {},
            "rng_tensors": [],
        }
        jp = os.path.join(tag, f"rank_{r:05d}.json")
        with open(jp, "wb") as f:
            f.write(dumps(table))
        files[os.path.basename(jp)] = file_record(*file_checksum(jp))
    meta = {
        "format": "zero-checkpoint",
        "format_version": 1,
        "world_size": 2,
        "files": files,
        "parameters": [[n, True, [per]] for n in names],
        "exclude_frozen_parameters": False,
    }
    with open(os.path.join(tag, "checkpoint.json"), "wb") as f:
        f.write(dumps(meta))
    import zero_core.checkpoint.zero_to_fp32 as z

    shutil.copy(z.__file__, os.path.join(tag, "zero_to_fp32.py"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("syn")


def _read_elems(path: str, name: str, start: int, count: int) -> torch.Tensor:
    """``count`` fp32 elements of tensor ``name`` of a safetensors file, read without loading it."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        lo, _ = header[name]["data_offsets"]
        assert header[name]["dtype"] == "F32"
        f.seek(8 + n + lo + 4 * start)
        return torch.frombuffer(bytearray(f.read(4 * count)), dtype=torch.float32)


def test_conversion_peak_rss_is_below_the_largest_shard(tmp_path):
    # tmpfs when there is one: the 816 MB output then costs no disk time on a shared machine
    scratch = tempfile.mkdtemp(dir="/dev/shm") if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    try:
        ckpt = os.path.join(scratch, "ckpt")
        _write_synthetic(ckpt)
        out = os.path.join(scratch, "out", "model.safetensors")
        script = os.path.join(ckpt, "syn", "zero_to_fp32.py")
        done = subprocess.run(
            [sys.executable, "-c", _MEASURE, script, ckpt, out, "--max-shard-size", SHARD, "-q"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RSS_KB"))
        _, base_kb, peak_kb, _, torch_loaded = line.split()
        increase = (int(peak_kb) - int(base_kb)) * 1024

        out_dir = os.path.dirname(out)
        index = json.load(open(os.path.join(out_dir, "model.safetensors.index.json")))
        shards = sorted(set(index["weight_map"].values()))
        largest = max(os.path.getsize(os.path.join(out_dir, s)) for s in shards)
        per = PARAMS // TENSORS
        assert len(shards) == 4 and index["metadata"]["total_size"] == PARAMS * 4
        assert largest >= 3 * per * 4  # the bound below is against a ~204 MB shard
        # the bound, and the design's: fp32 values are copied without making a tensor
        assert increase < 1.5 * largest, (increase, largest)
        assert increase < 64 * 2**20 and torch_loaded == "False", (increase, torch_loaded)

        # every fragment landed at its place: both ends of both halves of every tensor
        for i in range(TENSORS):
            name = f"layers.{i}.weight"
            path = os.path.join(out_dir, index["weight_map"][name])
            for r, (lo, hi) in enumerate([(0, per // 2), (per // 2, per)]):
                assert torch.equal(_read_elems(path, name, lo, MARK), _marker(i, r, False)), (name, r)
                assert torch.equal(_read_elems(path, name, hi - MARK, MARK), _marker(i, r, True)), (name, r)
            assert torch.equal(_read_elems(path, name, MARK, MARK), torch.zeros(MARK))  # the holes
    finally:
        if scratch != str(tmp_path):
            shutil.rmtree(scratch, ignore_errors=True)
