"""DeepSpeed's op interfaces, called as DeepSpeed's users call them: the aio handle's getters,
locked-buffer and read/write calls with DeepSpeed's argument orders and return values, and
CPUAdagrad with sparse (embedding) gradients."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from zero_ops.adagrad import CPUAdagrad
from zero_ops.aio import aio_handle

BLOCK, QD, PAR = 4096, 4, 2


def test_aio_handle_getters_with_deepspeed_arguments():
    # DeepSpeed: aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
    h = aio_handle(BLOCK, QD, True, False, PAR)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events()) == (
        BLOCK,
        QD,
        True,
        False,
    )
    assert h.get_intra_op_parallelism() == PAR
    assert aio_handle(BLOCK, intra_op_parallelism=3).get_intra_op_parallelism() == 3
    with pytest.raises(ValueError, match="same setting"):
        aio_handle(BLOCK, thread_count=2, intra_op_parallelism=3)


def test_aio_locked_tensor_and_transfers_as_deepspeed(tmp_path):
    h = aio_handle(BLOCK, QD, False, True, PAR)
    n = 3 * BLOCK + 100
    buf = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))  # (num_elem, example_tensor)
    assert buf.dtype == torch.uint8 and buf.numel() == n
    buf.copy_(torch.randint(0, 255, (n,), dtype=torch.uint8))
    path = str(tmp_path / "data.bin")
    assert h.sync_pwrite(buf, path) == 1  # completed requests
    back = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
    assert h.sync_pread(back, path) == 1
    assert torch.equal(back, buf)
    # async: 0 at submit, wait() counts the completed requests
    outs = [h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8)) for _ in range(3)]
    assert all(h.async_pread(o, path) == 0 for o in outs)
    assert h.wait() == 3 and all(torch.equal(o, buf) for o in outs)
    # pread/pwrite(buffer, filename, validate, async) and read/write(buffer, filename, validate)
    assert h.pwrite(buf, str(tmp_path / "v.bin"), True, False) == 1
    again = torch.empty_like(buf)
    assert h.pread(again, str(tmp_path / "v.bin"), False, True) == 0 and h.wait() == 1
    assert torch.equal(again, buf)
    assert h.read(again, path, True) == 1 and h.write(buf, str(tmp_path / "w.bin"), False) == 1
    for t in [buf, back, *outs]:
        h.free_cpu_locked_tensor(t)


def test_aio_calls_by_deepspeeds_keyword_names(tmp_path):
    # DeepSpeed's pybind signatures name every argument (buffer, filename, validate, async,
    # file_offset; fd for async_pwrite's descriptor overload) and its users call them by keyword,
    # e.g. writing a file piece by piece at offsets.
    h = aio_handle(
        block_size=BLOCK, queue_depth=QD, single_submit=True, overlap_events=True, intra_op_parallelism=PAR
    )
    data = torch.randint(0, 255, (3 * BLOCK,), dtype=torch.uint8)
    buf = h.new_cpu_locked_tensor(num_elem=data.numel(), example_tenosr=torch.empty(0, dtype=torch.uint8))
    buf.copy_(data)
    assert h.is_pinned(buffer=buf) and not h.is_pinned(torch.empty(4)) and h.get_alignment() == 4096
    path = str(tmp_path / "pieces.bin")
    for k in range(3):  # one block per call, at its offset
        piece = buf[k * BLOCK : (k + 1) * BLOCK]
        assert h.sync_pwrite(buffer=piece, filename=path, file_offset=k * BLOCK) == 1
    back = torch.zeros_like(data)
    assert h.sync_pread(buffer=back, filename=path, file_offset=0) == 1 and torch.equal(back, data)
    tail = torch.zeros(BLOCK, dtype=torch.uint8)
    assert h.async_pread(buffer=tail, filename=path, file_offset=2 * BLOCK) == 0 and h.wait() == 1
    assert torch.equal(tail, data[2 * BLOCK :])
    # async_pwrite to an open descriptor (fd=, or an int in the filename's place), at an offset
    fd_path = tmp_path / "by_fd.bin"
    fd = os.open(fd_path, os.O_CREAT | os.O_WRONLY)
    try:
        assert h.async_pwrite(buffer=buf[BLOCK:], fd=fd, file_offset=BLOCK) == 0 and h.wait() == 1
        assert h.async_pwrite(buf[:BLOCK], fd, 0) == 0 and h.wait() == 1
    finally:
        os.close(fd)
    assert fd_path.read_bytes() == data.numpy().tobytes()
    # pread/pwrite's ``async`` is a Python keyword: by position, async_op=, or **{"async": ...}
    other = str(tmp_path / "other.bin")
    assert h.pwrite(buffer=buf, filename=other, validate=True, **{"async": False}, file_offset=0) == 1
    again = torch.zeros_like(data)
    assert h.pread(buffer=again, filename=other, validate=False, **{"async": True}) == 0 and h.wait() == 1
    assert torch.equal(again, data)
    assert h.read(buffer=again, filename=other, validate=True) == 1
    assert h.write(buffer=buf, filename=str(tmp_path / "w.bin"), validate=False, file_offset=0) == 1
    h.free_cpu_locked_tensor(tensor=buf)
    # zero's earlier keyword names still work; giving both spellings is an error
    assert h.sync_pread(tensor=again, path=other, offset=0) == 1
    with pytest.raises(TypeError, match="both 'offset' and 'file_offset'"):
        h.sync_pread(again, other, offset=0, file_offset=0)
    with pytest.raises(TypeError, match="filename or fd, not both"):
        h.async_pwrite(buf, other, fd=3)


def test_aio_validate_catches_a_differing_file(tmp_path):
    from zero_ops.aio.handle import _validate

    h = aio_handle(BLOCK, QD, False, True, 1)
    path = str(tmp_path / "x.bin")
    t = torch.arange(100, dtype=torch.float32)
    assert h.write(t, path, True) == 1  # validated: the file holds the tensor
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(OSError, match="validation failed"):
        _validate(t, path, 0, "write")


def test_cpu_adagrad_sparse_embedding_gradients_match_torch():
    torch.manual_seed(0)
    ref = nn.Embedding(20, 4, sparse=True)
    mine = nn.Embedding(20, 4, sparse=True)
    mine.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.Adagrad(ref.parameters(), lr=0.1, lr_decay=0.01)
    opt = CPUAdagrad(mine.parameters(), lr=0.1, lr_decay=0.01)
    for step in range(4):
        ids = torch.tensor([[1, 5, 5, 7], [step, 9, 1, 19]])  # repeated ids are summed
        for emb, o in ((ref, opt_ref), (mine, opt)):
            o.zero_grad()
            emb(ids).pow(2).sum().backward()
            assert emb.weight.grad.is_sparse
            o.step()
        torch.testing.assert_close(mine.weight, ref.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[mine.weight]["sum"], opt_ref.state[ref.weight]["sum"])
    untouched = [i for i in range(20) if i not in (0, 1, 2, 3, 5, 7, 9, 19)]
    assert torch.all(opt.state[mine.weight]["sum"][untouched] == 0)


def test_cpu_adagrad_sparse_bf16_parameters_keep_an_fp32_master():
    emb = nn.Embedding(8, 3, sparse=True).to(torch.bfloat16)
    opt = CPUAdagrad(emb.parameters(), lr=0.1)
    emb(torch.tensor([2, 4])).float().sum().backward()
    opt.step()
    master = opt.state[emb.weight]["master_param"]
    assert master.dtype == torch.float32
    torch.testing.assert_close(emb.weight.float(), master, rtol=1e-2, atol=1e-2)
