"""The shard stores behind one protocol (See [Note: shard store seam] in zero-core): the plain
default, zero-offload's ParamOffload (cpu and nvme) and the int8 store of frozen weights give a
stage-3 parameter the same values through fetch, read, write, the gathers and the read-ahead of
a followed coordinator; and the optimizer offloads answer for masters they do not own with the
identity (See [Note: optimizer offload seam]), so stage code asks them without ``owns`` first.

The parameters hold integers in [-127, 127] with 127 or -127 in every block of 256 elements,
which int8 block quantization stores exactly: so the quantized store must agree bit for bit too.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from zero_core.protocols.shard_store import PLAIN_SHARDS, PlainShards, ShardStore
from zero_core.testing import run_multirank
from zero_core.zero.stage3.quantized_shards import QuantizedShardStore
from zero_offload import OptimizerOffload, ParamOffload

KINDS = ("plain", "cpu", "nvme", "quantized")
SIDE = 32  # 1024 elements: whole 256-element blocks in each rank's shard at world 1, 2 and 4


def _exact_int8(numel: int, shift: int = 0) -> torch.Tensor:
    """Integers in [-127, 127]; any 255 consecutive elements hold both -127 and 127."""
    return ((torch.arange(numel) * 37 + shift) % 255 - 127).float()


def _store(kind: str, rank: int, nvme_root: str) -> ShardStore:
    if kind == "plain":
        return PLAIN_SHARDS
    if kind == "quantized":
        return QuantizedShardStore()
    return ParamOffload(
        kind, rank=rank, nvme_path=nvme_root, buffer_count=2, buffer_size=SIDE * SIDE, max_in_cpu=0
    )


def _one_record(kind: str, nvme_root: str) -> dict:
    """fetch / release / read / write of one partitioned frozen parameter, and its gathers."""
    from zero_core import comm
    from zero_core.zero.stage3.param_records import partition_state
    from zero_core.zero.stage3.partitioned_param import gather_params, partition_param, release_param

    p = torch.nn.Parameter(_exact_int8(SIDE * SIDE).reshape(SIDE, SIDE), requires_grad=False)
    partition_param(p, None, broadcast_from=0)
    st = partition_state(p)
    store = _store(kind, comm.get_rank(), nvme_root)
    store.adopt([p])
    out: dict = {"is_record_store": st.store is store, "transient": store.transient}
    out["held_between_gathers"] = st.shard.untyped_storage().nbytes() > 0
    out["read"] = store.read(st).clone()
    store.fetch(st)
    out["fetched"] = st.shard.clone()
    store.release(st)
    out["held_after_release"] = st.shard.untyped_storage().nbytes() > 0
    handle = gather_params([p], what="shard store test")
    if handle is not None:
        handle.wait()
    out["gathered"] = p.detach().clone()
    release_param(p, force=True)
    store.write(st, _exact_int8(st.shard_numel, shift=st.rank + 1))
    out["read_after_write"] = store.read(st).clone()
    handle = gather_params([p], what="shard store test")
    if handle is not None:
        handle.wait()
    out["gathered_after_write"] = p.detach().clone()
    release_param(p, force=True)
    store.close()
    return out


class _Frozen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(SIDE, SIDE, bias=False) for _ in range(3)])
        for i, layer in enumerate(self.layers):
            layer.weight.data.copy_(_exact_int8(SIDE * SIDE, shift=i).reshape(SIDE, SIDE) / 64)
            layer.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _engine_forwards(kind: str, nvme_root: str) -> dict:
    """Forwards of a frozen model under a stage-3 engine whose shards live in ``kind``'s store
    (the engine adopts them, follows its coordinator, fetches them in every gather)."""
    import zero_core

    zo: dict = {"stage": 3, "param_persistence_threshold": 0, "stage3_prefetch_bucket_size": SIDE * SIDE}
    if kind in ("cpu", "nvme"):
        zo["offload_param"] = {
            "device": kind,
            "nvme_path": nvme_root,
            "buffer_count": 4,
            "buffer_size": SIDE * SIDE,
        }
        zo["offload_param"]["max_in_cpu"] = 0
    if kind == "quantized":
        zo["zero_quantized_nontrainable_weights"] = True
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zo}
    torch.manual_seed(0)
    engine, *_ = zero_core.initialize(model=_Frozen(), config=cfg)
    x = torch.linspace(-1, 1, 2 * SIDE).reshape(2, SIDE)
    outs = [engine(x).detach().clone() for _ in range(3)]  # the trace is recorded by the first
    stores = engine.strategy.shard_stores()
    out = {
        "outs": outs,
        "stores": sorted(type(s).__name__ for s in stores),
        "followed": all(
            getattr(s, "coordinator", engine.strategy.coordinator) is engine.strategy.coordinator
            for s in stores
        ),
        "read_ahead_hits": sum(getattr(s, "read_ahead_hits", 0) for s in stores),
    }
    engine.destroy()
    return out


def _all_kinds(nvme_root: str) -> dict:
    return {kind: (_one_record(kind, nvme_root), _engine_forwards(kind, nvme_root)) for kind in KINDS}


@pytest.mark.parametrize("world", [1, 2])
def test_every_store_gives_the_plain_values(world: int, tmp_path) -> None:
    for rank_out in run_multirank(_all_kinds, world, args=(str(tmp_path),), timeout=300):
        plain_record, plain_engine = rank_out["plain"]
        assert plain_record["is_record_store"] and not plain_record["transient"]
        assert plain_record["held_between_gathers"] and plain_record["held_after_release"]
        assert plain_engine["stores"] == ["PlainShards"]
        for kind in KINDS[1:]:
            record, engine = rank_out[kind]
            assert record["is_record_store"] and record["transient"], kind
            # a transient store's device copy exists only between fetch and release
            assert not record["held_between_gathers"] and not record["held_after_release"], kind
            for key in ("read", "fetched", "gathered", "read_after_write", "gathered_after_write"):
                torch.testing.assert_close(
                    record[key], plain_record[key], rtol=0, atol=0, msg=f"{kind} {key}"
                )
            assert engine["followed"], kind
            for got, want in zip(engine["outs"], plain_engine["outs"]):
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=kind)
        assert rank_out["cpu"][1]["stores"] == ["ParamOffload"]
        assert rank_out["quantized"][1]["stores"] == ["QuantizedShardStore"]
        # NVMe homes are read ahead in the recorded module order of the coordinator it follows
        assert rank_out["nvme"][1]["read_ahead_hits"] > 0


@pytest.mark.parametrize("cls", [PlainShards, ParamOffload, QuantizedShardStore])
def test_stores_implement_the_protocol_with_its_parameters(cls: type) -> None:
    store = cls("cpu") if cls is ParamOffload else cls()
    assert isinstance(store, ShardStore)
    for name, member in inspect.getmembers(ShardStore, inspect.isfunction):
        if not name.startswith("_"):
            want = list(inspect.signature(member).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)


def test_optimizer_offload_answers_for_masters_it_does_not_own() -> None:
    """``offload_optimizer.ratio`` < 1 leaves some masters on the device: the offload answers for
    them as the null offload does (the master itself, the optimizer's own state)."""
    owned = torch.nn.Parameter(torch.ones(4))
    mine = torch.nn.Parameter(torch.full((4,), 2.0))
    offload = OptimizerOffload("cpu")
    try:
        (host,) = offload.adopt([owned])
        opt = torch.optim.Adam([host, mine], lr=0.1)
        offload.finalize(opt)
        mine.grad = torch.full((4,), 0.5)
        opt.step()  # the device-side master's own state
        assert offload.owns(host) and not offload.owns(mine)
        assert offload.master_value(mine).data_ptr() == mine.data_ptr()
        assert offload.updated(mine).data_ptr() == mine.data_ptr()
        assert offload.state_of(opt, mine) is opt.state[mine]
        live = opt.state[mine]["exp_avg"]
        offload.load_state(opt, mine, {"exp_avg": torch.full((4,), 3.0)})
        assert opt.state[mine]["exp_avg"] is live and torch.equal(live, torch.full((4,), 3.0))
        offload.set_master(mine, torch.arange(4.0))
        assert torch.equal(mine.detach(), torch.arange(4.0))
        offload.begin_staging(True)
        offload.stage_grad(mine, torch.ones(4))
        offload.stage_grad_range(mine, 0, torch.ones(4))
        assert not offload.is_staged(mine)  # nothing of it went to the host
        torch.testing.assert_close(offload.master_value(host), torch.ones(4), rtol=0, atol=0)
    finally:
        offload.close()
