#!/usr/bin/env python
"""Checkpoint fault injection: kill, flip, forge, edit, fill the disk; each case returns a verdict.

Usage: ``hatch run python tools/faults/checkpoint_cases.py [--full] [--seed S] [--workdir DIR]``
prints the table (case, expected, observed, verdict) and the totals ("N kills with 0 losses,
N corruptions with 0 silent loads"); it exits 1 if any case failed. The default (small N)
runs in well under two minutes on a quiet 2-core machine; ``--full`` runs more kills and flips.

Every case is a function returning ``(case, expected, observed, verdict)`` with ``verdict``
``"ok"`` or ``"FAIL"``, so the runtime fault-injection script and the regression tests
(``tests/test_checkpoint_faults.py``) call the same injections. The faults are the ones of
issue 25: a rank SIGKILLed mid-save of a zero-pipe checkpoint re-saving its tag (the last
good one must load, with its weights); 1, 2 and 3 flipped bits anywhere in a tensor file
(including the two sign-bit flips that the old ``sum64`` missed); forged safetensors headers
(overlapping, gapped, out-of-bounds offsets, dtype/shape disagreement, duplicate names) with
the checksums recomputed as an attacker would; edited ``checkpoint.json`` values (with and
without resealing); a world-size-2 checkpoint recorded as world size 1; a full disk (ENOSPC)
during a save; and path-escaping tags.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Case = tuple[str, str, str, str]
OK, FAIL = "ok", "FAIL"
REJECT = "rejected, naming the file"


# -- a small engine and its checkpoint ------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 64)
        self.l2 = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x))).pow(2).mean()


def _engine(lr: float = 1e-3) -> Any:
    import zero_core

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": lr}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = zero_core.initialize(model=Net(), config=cfg)
    return engine


def _step(engine: Any) -> None:
    engine.backward(engine(torch.randn(2, 5)))
    engine.step()


def _save_base(root: str) -> None:
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(root, tag="base")


def make_base_checkpoint(root: str) -> str:
    """A world-size-2 engine checkpoint (tag ``base``) under ``root``; returns ``root``."""
    from zero_core.testing import run_multirank

    run_multirank(_save_base, 2, args=(root,), timeout=300)
    return root


def _copy(src: str, dst: str) -> str:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def _verdict(case: str, expected: str, fn: Callable[[], Any], ok_if: Callable[[BaseException], bool]) -> Case:
    """Run ``fn`` (a load of a damaged checkpoint): it must raise an error that ``ok_if`` accepts."""
    try:
        fn()
    except Exception as e:  # the error is the observation
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return case, expected, msg, OK if ok_if(e) else FAIL
    return case, expected, "SILENT LOAD (no error)", FAIL


def _engine_load(root: str) -> Callable[[], Any]:
    def load() -> Any:
        return _engine().load_checkpoint(root, tag="base")

    return load


def _script_load(root: str) -> Callable[[], Any]:
    def load() -> Any:
        from zero_core.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(root, tag="base")

    return load


# -- bit flips ---------------------------------------------------------------------------
def _flip(path: str, bits: list[int]) -> None:
    with open(path, "r+b") as f:
        for b in bits:
            f.seek(b // 8)
            byte = f.read(1)[0]
            f.seek(b // 8)
            f.write(bytes([byte ^ (1 << (b % 8))]))


def flip_case(base: str, work: str, k: int, rng: random.Random, *, bits: list[int] | None = None) -> Case:
    """Flip ``k`` random bits (or the given ``bits``) of rank 1's tensor file; engine and script must refuse."""
    root = _copy(base, work)
    path = os.path.join(root, "base", "rank_00001.safetensors")
    size = os.path.getsize(path)
    bits = bits if bits is not None else rng.sample(range(8 * size), k)
    _flip(path, bits)
    name = f"flip {len(bits)} bit(s) of rank_00001.safetensors at {bits[:3]}"

    def both() -> None:
        errors = []
        for load in (_engine_load(root), _script_load(root)):
            try:
                load()
                errors.append("SILENT")
            except Exception as e:
                errors.append(str(e))
        if any(e == "SILENT" for e in errors):
            return None  # reported as silent below
        raise RuntimeError(" | ".join(errors))

    return _verdict(
        name, "both loaders refuse it", both, lambda e: str(e).count("rank_00001.safetensors") >= 2
    )


def sum64_blind_spot_bits(path: str) -> list[int]:
    """Two sign-bit flips in 64-bit words of the same parity: the old ``sum64`` missed them."""
    words = os.path.getsize(path) // 8
    i = words // 2
    return [64 * i + 63, 64 * (i + 2) + 63]


# -- forged headers (checksums recomputed, as an attacker would) ----------------------------
def _rewrite_header(path: str, edit: Callable[[dict], None]) -> None:
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    body = data[8 + n :]
    open(path, "wb").write(struct.pack("<Q", len(raw)) + raw + body)


def rerecord(tag_dir: str, rank: int) -> None:
    """Make every checksum and the seal agree with rank ``rank``'s (modified) tensor file."""
    from zero_core.checkpoint.format import dumps, read_json
    from zero_core.checkpoint.integrity import file_crc32c, file_record
    from zero_core.checkpoint.metadata import sealed_bytes

    table_path = os.path.join(tag_dir, f"rank_{rank:05d}.json")
    table = read_json(table_path)
    n, crcs = file_crc32c(os.path.join(tag_dir, table["file"]))
    table["file_record"] = file_record(n, crc32c=crcs)
    open(table_path, "wb").write(dumps(table))
    meta_path = os.path.join(tag_dir, "checkpoint.json")
    meta = read_json(meta_path)
    meta.pop("seal", None)
    n, crcs = file_crc32c(table_path)
    meta["files"][f"rank_{rank:05d}.json"] = file_record(n, crc32c=crcs)
    open(meta_path, "wb").write(sealed_bytes(meta))


def _forgeries() -> dict[str, Callable[[dict], None]]:
    def entries(h: dict) -> list[tuple[str, dict]]:
        return sorted(
            ((k, v) for k, v in h.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"]
        )

    def overlap(h: dict) -> None:  # the second tensor aliases the first one's bytes
        (_, a), (_, b) = entries(h)[:2]
        n = b["data_offsets"][1] - b["data_offsets"][0]
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + n]

    def gap(h: dict) -> None:  # one element skipped between two tensors
        (_, a), *_ = entries(h)
        a["shape"] = [a["shape"][0] - 1] + a["shape"][1:] if a["shape"] else a["shape"]
        a["data_offsets"][1] -= 4

    def out_of_bounds(h: dict) -> None:
        k, v = entries(h)[-1]
        v["data_offsets"] = [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]

    def dtype_mismatch(h: dict) -> None:
        (_, a), *_ = entries(h)
        a["dtype"] = "F16"  # same offsets: half the bytes its shape needs

    def shape_mismatch(h: dict) -> None:
        (_, a), *_ = entries(h)
        a["shape"] = [2 * max(1, a["shape"][0])] + a["shape"][1:]

    return {
        "overlapping offsets": overlap,
        "gapped offsets": gap,
        "out-of-bounds offsets": out_of_bounds,
        "dtype disagrees with span": dtype_mismatch,
        "shape disagrees with span": shape_mismatch,
    }


def forge_case(base: str, work: str, kind: str) -> Case:
    """Forge rank 1's tensor file header (``kind`` of :func:`_forgeries`), re-record; both loaders refuse."""
    root = _copy(base, work)
    tag_dir = os.path.join(root, "base")
    _rewrite_header(os.path.join(tag_dir, "rank_00001.safetensors"), _forgeries()[kind])
    rerecord(tag_dir, 1)
    observed = []
    for load in (_engine_load(root), _script_load(root)):
        case = _verdict(
            f"forge: {kind}", "", load, lambda e: "rank_00001.safetensors" in str(e) and "tensor" in str(e)
        )
        observed.append(case)
    verdict = OK if all(c[3] == OK for c in observed) else FAIL
    return f"forge: {kind}", "both loaders refuse it, naming file and tensor", observed[0][2], verdict


def forge_duplicate_case(base: str, work: str) -> Case:
    """A header naming one tensor twice (JSON keeps the last): refused."""
    root = _copy(base, work)
    tag_dir = os.path.join(root, "base")
    path = os.path.join(tag_dir, "rank_00001.safetensors")
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + n].rstrip()
    first = raw[1 : raw.index(b"}") + 1]  # the first entry, repeated at the end
    forged = raw[:-1] + b"," + first + b"}"
    forged += b" " * (-len(forged) % 8)
    open(path, "wb").write(struct.pack("<Q", len(forged)) + forged + data[8 + n :])
    rerecord(tag_dir, 1)
    return _verdict("forge: duplicate tensor name", REJECT, _engine_load(root), lambda e: "twice" in str(e))


# -- edited metadata --------------------------------------------------------------------
def _edit_meta(root: str, edit: Callable[[dict], None], reseal: bool) -> None:
    from zero_core.checkpoint.format import dumps, read_json
    from zero_core.checkpoint.metadata import sealed_bytes

    path = os.path.join(root, "base", "checkpoint.json")
    meta = read_json(path)
    seal = meta.pop("seal")
    edit(meta)
    open(path, "wb").write(sealed_bytes(meta) if reseal else dumps({**meta, "seal": seal}))


def _edits() -> dict[str, Callable[[dict], None]]:
    def lr(m: dict) -> None:
        m["optimizer"]["param_groups"][0]["lr"] = 10.0

    def steps(m: dict) -> None:
        m["global_steps"] = 1000

    def scale(m: dict) -> None:
        m["loss_scaler"]["cur_scale"] = -1.0

    return {"lr": lr, "global_steps": steps, "loss scale < 0": scale}


def edit_case(base: str, work: str, what: str, reseal: bool) -> Case:
    """Edit one value of checkpoint.json; unsealed -> the seal fails, resealed -> range checks (where wrong)."""
    root = _copy(base, work)
    _edit_meta(root, _edits()[what], reseal)
    name = f"edit checkpoint.json: {what}" + (" (resealed)" if reseal else "")
    expect = "range check names the value" if reseal else "seal check fails"
    key = "cur_scale" if reseal else "seal"
    return _verdict(name, expect, _engine_load(root), lambda e: "checkpoint.json" in str(e) and key in str(e))


def world_size_case(base: str, work: str) -> Case:
    """A world-size-2 checkpoint recorded (and resealed) as world size 1: the mismatch is named."""
    root = _copy(base, work)
    _edit_meta(root, lambda m: m.update(world_size=1), reseal=True)
    return _verdict(
        "world size 2 recorded as 1 (resealed)",
        "names the world-size mismatch",
        _engine_load(root),
        lambda e: "world size" in str(e) and "missing" not in str(e),
    )


# -- full disk, tags ----------------------------------------------------------------------
def enospc_case(work: str) -> Case:
    """The disk fills while rank 0 writes its tensor file: error names the file; no staging left."""
    from zero_core.checkpoint import atomic

    root = _copy(tempfile.mkdtemp(), work)
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(root, tag="good")
    real = atomic._write_all

    def full(f: Any, view: memoryview) -> None:
        if f.name.endswith(".safetensors" + f".tmp.{os.getpid()}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, view)

    atomic._write_all = full
    try:
        engine.save_checkpoint(root, tag="next")
        observed = "save succeeded on a full disk"
    except OSError as e:
        observed = f"{type(e).__name__}: {e}"
    finally:
        atomic._write_all = real
    left = [n for n in os.listdir(root) if n.startswith(".") or ".tmp" in n]
    latest = open(os.path.join(root, "latest")).read()
    named = "rank_00000.safetensors" in observed and "No space" in observed
    verdict = OK if named and not left and latest == "good" else FAIL
    return (
        "ENOSPC during save",
        "error names the file; no staging left; latest kept",
        observed[:160] + (f"; left {left}" if left else ""),
        verdict,
    )


def traversal_case(work: str) -> Case:
    """Tags ``..`` on save and a ``latest`` naming ``../x`` on load are refused."""
    root = _copy(tempfile.mkdtemp(), work)
    engine = _engine()
    observed = []
    try:
        engine.save_checkpoint(root, tag="..")
        observed.append("saved under '..'")
    except ValueError as e:
        observed.append(f"save refused: {str(e)[:60]}")
    open(os.path.join(root, "latest"), "w").write("../escape")
    try:
        engine.load_checkpoint(root)
        observed.append("loaded '../escape'")
    except Exception as e:
        observed.append(f"load refused: {str(e)[:60]}")
    verdict = OK if all("refused" in o for o in observed) else FAIL
    return "tag '..' / latest '../escape'", "both refused", "; ".join(observed), verdict


# -- kill -9 mid-save of a zero-pipe checkpoint -------------------------------------------
def _pipe_engine(seed: int) -> Any:
    from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

    torch.manual_seed(seed)
    model = PipelineModule(
        [LayerSpec(nn.Linear, 6, 6) for _ in range(4)],
        num_stages=2,
        loss_fn=nn.functional.mse_loss,
        partition_method="uniform",
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return PipelineEngine(model, opt, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})


def _pipe_train(engine: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    engine.train_batch(
        iter([(torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)) for _ in range(2)])
    )


def _digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode() + v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _pipe_save_then_die(root: str, victim: int, budget: int) -> None:
    import torch.distributed as dist
    from zero_core.checkpoint import atomic

    engine = _pipe_engine(0)
    _pipe_train(engine, 1)
    engine.save_checkpoint(root, tag="t")
    with open(os.path.join(root, f"digest_{dist.get_rank()}"), "w") as f:
        f.write(_digest(engine.module))
    _pipe_train(engine, 2)
    if dist.get_rank() == victim:
        atomic._written_total = 0
        os.environ["ZERO_CHECKPOINT_KILL_AFTER_BYTES"] = str(budget)
    engine.save_checkpoint(root, tag="t")  # re-saving the same tag, as issue 25 item 2 describes


def _pipe_load(root: str) -> tuple[bool, int]:
    import torch.distributed as dist

    engine = _pipe_engine(7)  # other initial weights
    engine.load_checkpoint(root)
    with open(os.path.join(root, f"digest_{dist.get_rank()}")) as f:
        return _digest(engine.module) == f.read(), engine.global_steps


def pipe_kill_case(work: str, victim: int, budget: int) -> Case:
    """SIGKILL rank ``victim`` after ``budget`` bytes of its re-save of tag ``t``: the last good ``t`` loads."""
    from zero_core.testing import RankFailedError, run_multirank

    root = _copy(tempfile.mkdtemp(), work)
    name = f"kill -9 pipe rank {victim} after {budget} bytes of re-saving tag t"
    try:
        run_multirank(_pipe_save_then_die, 2, args=(root, victim, budget), timeout=300)
        killed = "NOT KILLED: the save finished before the kill point (lower the budget)"
    except RankFailedError as e:
        killed = "killed" if "SIGKILL" in str(e) else f"failed otherwise: {str(e)[:100]}"
    try:
        results = run_multirank(_pipe_load, 2, args=(root,), timeout=300)
        same = all(r[0] for r in results) and results[0][1] == 1
        observed = f"{killed}; loaded step {results[0][1]}, weights {'= last good' if same else 'DIFFER'}"
        good = same and killed == "killed"
    except Exception as e:
        observed, good = f"{killed}; load failed: {str(e).splitlines()[0][:120]}", False
    return name, "the last complete checkpoint loads", observed, OK if good else FAIL


# -- running them -------------------------------------------------------------------------
def _single_process_cases(base: str, work: str, flips: int, seed: int) -> list[Case]:
    from zero_core.checkpoint.integrity import sum64_reference

    rng = random.Random(seed)
    cases = []
    for k in (1, 2, 3):
        for i in range(flips):
            cases.append(flip_case(base, os.path.join(work, f"flip{k}_{i}"), k, rng))
    path = os.path.join(base, "base", "rank_00001.safetensors")
    blind = sum64_blind_spot_bits(path)
    data = bytearray(open(path, "rb").read())
    before = sum64_reference(bytes(data))
    for b in blind:
        data[b // 8] ^= 1 << (b % 8)
    case = flip_case(base, os.path.join(work, "blind"), 2, rng, bits=blind)
    missed = sum64_reference(bytes(data)) == before
    cases.append((case[0] + f" (sum64 misses it: {missed})", *case[1:]))
    for kind in _forgeries():
        cases.append(forge_case(base, os.path.join(work, "forge"), kind))
    cases.append(forge_duplicate_case(base, os.path.join(work, "forge")))
    for what in _edits():
        cases.append(edit_case(base, os.path.join(work, "edit"), what, reseal=False))
    cases.append(edit_case(base, os.path.join(work, "edit"), "loss scale < 0", reseal=True))
    cases.append(world_size_case(base, os.path.join(work, "world")))
    cases.append(enospc_case(os.path.join(work, "enospc")))
    cases.append(traversal_case(os.path.join(work, "traversal")))
    return cases


def run_cases(work: str, *, kills: int = 2, flips: int = 2, seed: int = 0) -> list[Case]:
    """Every case, in ``work``: ``kills`` pipe kills, ``flips`` flips of each of 1, 2 and 3 bits."""
    from zero_core.testing import run_multirank

    base = make_base_checkpoint(os.path.join(work, "base"))
    cases = run_multirank(_single_process_cases, 1, args=(base, work, flips, seed), timeout=600)[0]
    rng = random.Random(seed)
    for i in range(kills):
        budget = rng.choice([100, 400, 1200, 2500])  # a rank writes ~4 KB: layers, then its optimizer state
        cases.append(pipe_kill_case(os.path.join(work, f"kill{i}"), i % 2, budget))
    return cases


def case_checkpoint_faults(full: bool = False) -> list[Case]:
    """Every checkpoint case, as ``run_faults.py`` runs it: 10 kills and 10 flips of each weight
    with ``full``, else 2 of each."""
    work = tempfile.mkdtemp(prefix="zero-ckpt-faults-")
    try:
        n = 10 if full else 2
        return run_cases(work, kills=n, flips=n)
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: what ``run_faults.py`` finds and runs
CASES = [case_checkpoint_faults]


def totals(cases: list[Case]) -> str:
    kills = [c for c in cases if c[0].startswith("kill")]
    corrupt = [c for c in cases if c[0].startswith(("flip", "forge", "edit", "world"))]
    lost = sum(c[3] != OK for c in kills)
    silent = sum("SILENT" in c[2] for c in corrupt)
    other = sum(c[3] != OK for c in cases if c not in kills and c not in corrupt)
    return (
        f"{len(kills)} kills with {lost} losses; {len(corrupt)} corruptions with {silent} silent loads "
        f"({sum(c[3] != OK for c in corrupt)} failed verdicts); {len(cases) - len(kills) - len(corrupt)} other "
        f"cases with {other} failures"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="more kills (10) and flips (10 of each weight)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="zero-ckpt-faults-")
    t0 = time.perf_counter()
    cases = run_cases(work, kills=10 if args.full else 2, flips=10 if args.full else 2, seed=args.seed)
    width = max(len(c[0]) for c in cases)
    for c in cases:
        print(f"{c[0]:<{width}} | {c[1]} | {c[2]} | {c[3]}")
    print(totals(cases), f"[{time.perf_counter() - t0:.0f} s]")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(c[3] == OK for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
