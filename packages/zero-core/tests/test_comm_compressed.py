"""compressed_all_reduce: bit packing, the two-phase 1-bit average with error feedback, its logged bytes."""

from __future__ import annotations

import pytest
import torch
from zero_core import comm
from zero_core.comm import comms_logger
from zero_core.comm.compressed import compressed_size, pack_signs, padded_numel, unpack_signs
from zero_core.testing import multirank


def test_pack_unpack_round_trip_and_sign_of_zero():
    x = torch.tensor([1.5, -2.0, 0.0, -0.0, 3.0, -1e-9, 7.0, -7.0, -1.0, 2.0, 0.5, -0.5, 1.0, 1.0, -3.0, 4.0])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 2  # 8 signs per byte
    # 1.5 -2 0 -0 3 -1e-9 7 -7 -> + - + - + - + - (the sign bit decides: +0 is +, -0 is -);
    # element k of a byte's eight is bit k
    assert packed[0].item() == 0b01010101
    signs = unpack_signs(packed, torch.float32)
    assert torch.equal(signs, torch.where(torch.signbit(x), -1.0, 1.0))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(7))


def test_padded_numel():
    assert padded_numel(1, 2) == 16 and padded_numel(16, 2) == 16 and padded_numel(17, 4) == 32
    assert compressed_size(32, 2, num_segments=3) == 2 * (16 // 8 + 12)


def _compress_rows(c: torch.Tensor, seg: torch.Tensor, segments: int) -> torch.Tensor:
    """Reference: each row, per segment, as rms(segment) * sign (+ where the sign bit is clear)."""
    out = torch.empty_like(c)
    for i in range(c.shape[0]):
        for s in range(segments):
            cols = (seg == s).nonzero().flatten()
            vals = c[i, cols]
            scale = vals.square().mean().sqrt()
            out[i, cols] = scale * torch.where(torch.signbit(vals), -1.0, 1.0)
    return out


def _reference(xs, worker, server, seg, segments, n):
    """The dense average of every rank's compressed (x + worker_error), plus the server's error term."""
    width = xs[0].numel() // n
    sent, new_worker = [], []
    for x, w in zip(xs, worker):
        c = (x + w).view(n, width)
        q = _compress_rows(c, seg, segments)
        sent.append(q)
        new_worker.append((c - q).reshape(-1))
    result, new_server = [], []
    for i in range(n):
        avg = torch.stack([q[i] for q in sent]).mean(dim=0) + server[i]
        q = _compress_rows(avg.unsqueeze(0), seg, segments)[0]
        result.append(q)
        new_server.append(avg - q)
    return torch.cat(result), new_worker, new_server


def _inputs(n: int, numel: int, call: int):
    g = torch.Generator().manual_seed(100 + call)
    xs = [torch.randn(numel, generator=g) * (r + 1) for r in range(n)]
    return xs


@multirank(world_sizes=(2, 4))
def test_result_is_average_of_compressed_plus_error_feedback(world_size):
    n, rank = world_size, comm.get_rank()
    numel = padded_numel(50, n)
    width = numel // n
    segments = 3
    sizes = [width // 3, width // 3, width - 2 * (width // 3)]
    seg = torch.repeat_interleave(torch.arange(segments), torch.tensor(sizes))
    g = torch.Generator().manual_seed(7)
    worker = [torch.randn(numel, generator=g) * 0.1 for _ in range(n)]
    server = [torch.randn(width, generator=g) * 0.1 for _ in range(n)]
    my_worker, my_server = worker[rank].clone(), server[rank].clone()
    comms_logger.reset()
    comms_logger.enable()
    try:
        for call in range(3):  # the error buffers carry from one call to the next
            xs = _inputs(n, numel, call)
            expected, worker, server = _reference(xs, worker, server, seg, segments, n)
            out = xs[rank].clone()
            comm.compressed_all_reduce(out, my_worker, my_server, segment_sizes=sizes)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(my_worker, worker[rank], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(my_server, server[rank], rtol=1e-5, atol=1e-6)
    finally:
        comms_logger.disable()
    assert comms_logger.count_for("compressed_all_reduce") == 3
    # per call: n chunks of width/8 bytes of bits + one fp32 scale per segment
    assert comms_logger.bytes_for("compressed_all_reduce") == 3 * n * (width // 8 + 4 * segments)
    assert comms_logger.bytes_for("all_reduce") == 0  # its inner exchange is not counted twice


@multirank(world_sizes=(2,))
def test_known_values_single_scale():
    # both ranks hold +-2: signs agree, so the average is exact and no error is left
    rank = comm.get_rank()
    x = torch.tensor([2.0, -2.0] * 8)
    out, w, s = x.clone(), torch.zeros(16), torch.zeros(8)
    comm.compressed_all_reduce(out, w, s)
    assert torch.equal(out, x) and not w.any() and not s.any()
    # rank 0 holds 4, rank 1 holds 0: the average 2 is exact; rank 1's zeros become +scale 0
    y = torch.full((16,), 4.0 if rank == 0 else 0.0)
    comm.compressed_all_reduce(y, w, s)
    assert torch.equal(y, torch.full((16,), 2.0))


@multirank(world_sizes=(2,))
def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of 8 x world_size"):
        comm.compressed_all_reduce(torch.ones(10), torch.zeros(10), torch.zeros(5))
    with pytest.raises(ValueError, match="server_error"):
        comm.compressed_all_reduce(torch.ones(16), torch.zeros(16), torch.zeros(4))
    with pytest.raises(ValueError, match="dtype and device"):
        comm.compressed_all_reduce(torch.ones(16), torch.zeros(16, dtype=torch.float64), torch.zeros(8))
    with pytest.raises(ValueError, match="segment_sizes"):
        comm.compressed_all_reduce(torch.ones(16), torch.zeros(16), torch.zeros(8), segment_sizes=[3, 4])
    with pytest.raises(TypeError, match="torch.Tensor"):
        comm.compressed_all_reduce([1.0], torch.zeros(16), torch.zeros(8))
