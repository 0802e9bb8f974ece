"""Bucketed, overlapped gradient all-reduce for data parallelism (ZeRO stage 0).

[Note: gradient buckets]
Gradients are reduced in buckets of about ``reduce_bucket_size`` elements so that the
reduction of the last layers' gradients runs (asynchronously, on the communication
backend's own threads) while autograd is still computing the first layers' gradients.
Parameters are assigned to buckets in reverse registration order, which approximates the
order in which backward produces their gradients.

Two rules keep every rank's sequence of collectives identical, which is what prevents hangs:
buckets are launched strictly in bucket order (bucket k only after buckets 0..k-1), and
whatever has not been launched when backward ends is launched, in order, by ``finish()``.

A parameter may get no gradient on some rank (unused in that rank's forward). Each bucket
carries one extra element per parameter holding 1 if this rank produced a gradient; after
the SUM the count tells whether any rank did. A parameter no rank produced a gradient for
keeps ``grad = None`` (so optimizers skip it exactly as in single-process PyTorch); one that
only some ranks used is averaged with zeros from the others. A sparse gradient
(``nn.Embedding(..., sparse=True)``) is densified into its slot and comes back dense (See
[Note: sparse gradients]).

Bucket size: an explicit ``zero_optimization.reduce_bucket_size`` is honoured. Without one,
stage 0 does not use that key's default (5e8 elements, sized for the ZeRO stages' reduce
buffers): below 500M parameters it makes a single bucket, launched only when backward has
finished, so nothing overlaps. Stage 0 uses ``STAGE0_DEFAULT_BUCKET_NUMEL`` instead, 25 MiB of
fp32 as torch DDP does; measured on the demo GPT (19M parameters, 2 ranks, gloo) the single
bucket was 1.14x DDP's step time and the 25 MiB buckets 1.00x (tools/bench/bench_stage0.py).

Each bucket's flat buffer is allocated once and reused: a fresh multi-megabyte buffer per step
costs page faults on every step. After the reduction the averaged gradients are left as views
of the buffer (no copy back; the buffer is divided once). The engine sets ``grad = None`` after
every optimizer step, so a boundary's backward always produces gradients in new tensors before
they are copied into the buffer; a gradient that still is its own slot is not copied.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zero_core import comm

#: Stage 0's bucket size when the config gives no ``reduce_bucket_size``: 25 MiB of fp32.
STAGE0_DEFAULT_BUCKET_NUMEL = 25 * 2**20 // 4


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    ready: set[int] = field(default_factory=set)
    launched: bool = False
    buffer: torch.Tensor | None = None
    work: Any = None
    had_grad: list[bool] = field(default_factory=list)  # this rank's, at the last launch


class BucketedAllReduce:
    """Averages ``.grad`` of ``params`` over ``group`` in ordered, overlapped buckets."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        bucket_numel: int,
        group: Any = None,
        overlap: bool = True,
        comm_dtype: torch.dtype | None = None,
        predivide_factor: float = 1.0,
        divisor: int | None = None,
    ) -> None:
        if bucket_numel < 1:
            raise ValueError(f"reduce_bucket_size must be >= 1 element, got {bucket_numel}")
        self.group = group
        # Averaging divisor: the group's size, except for expert parameters (reduced over the
        # expert-data-parallel group but averaged over the whole data-parallel world).
        self.world_size = divisor if divisor is not None else comm.get_world_size(group)
        self.overlap = overlap
        self.comm_dtype = comm_dtype
        self.predivide_factor = float(predivide_factor)
        trainable = [p for p in params if p.requires_grad]
        self.buckets = self._assign(list(reversed(trainable)), bucket_numel)
        self._where: dict[int, tuple[int, int]] = {}
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
        self._next = 0
        self.armed = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]

    @staticmethod
    def _assign(params: Sequence[torch.nn.Parameter], bucket_numel: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        cur: list[torch.nn.Parameter] = []
        offsets: list[int] = []
        size = 0
        for p in params:
            if cur and size + p.numel() > bucket_numel:
                buckets.append(_Bucket(cur, offsets, size))
                cur, offsets, size = [], [], 0
            cur.append(p)
            offsets.append(size)
            size += p.numel()
        if cur:
            buckets.append(_Bucket(cur, offsets, size))
        return buckets

    def arm(self) -> None:
        """Reduce during the coming backward (call on gradient-accumulation boundaries only)."""
        for b in self.buckets:
            b.ready.clear()
            b.launched = False
            b.work = None
        self._next = 0
        self.armed = True

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        b, i = self._where[id(param)]
        self.buckets[b].ready.add(i)
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        n = len(bucket.params)
        grads = [p.grad for p in bucket.params]
        dtype = self.comm_dtype or next((g.dtype for g in grads if g is not None), bucket.params[0].dtype)
        buf = bucket.buffer
        if buf is None or buf.dtype != dtype:
            # allocated once and reused every step (see [Note: gradient buckets])
            buf = torch.empty(bucket.numel + n, dtype=dtype, device=bucket.params[0].device)
            bucket.buffer = buf
        for p, off, g in zip(bucket.params, bucket.offsets, grads):
            dst = buf[off : off + p.numel()]
            if g is None:
                dst.zero_()
            elif g.is_sparse:  # nn.Embedding(sparse=True): reduced dense (See [Note: sparse gradients])
                dst.copy_(g.to_dense().reshape(-1))
            elif g.data_ptr() != dst.data_ptr():  # not already this slot (see finish())
                dst.copy_(g.reshape(-1))
        bucket.had_grad = [g is not None for g in grads]
        buf[bucket.numel :] = torch.tensor(bucket.had_grad, dtype=dtype)
        if self.predivide_factor != 1.0:
            buf[: bucket.numel].div_(self.predivide_factor)
        bucket.launched = True
        bucket.work = comm.all_reduce(buf, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch what is left, wait for every bucket and write the averaged gradients back."""
        if not self.armed:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        post = self.world_size / self.predivide_factor
        for bucket in self.buckets:
            bucket.work.wait()
            buf = bucket.buffer
            assert buf is not None
            buf[: bucket.numel].div_(post)
            # Which parameters got a gradient on some rank: a host read, needed only when this
            # rank lacks one (with a local gradient the count is >= 1), so the usual step has none.
            # See [Note: scalars stay on the device in the step].
            local = bucket.had_grad
            counts = [1] * len(bucket.params) if all(local) else buf[bucket.numel :].tolist()
            for p, off, count in zip(bucket.params, bucket.offsets, counts):
                if count == 0:
                    p.grad = None
                    continue
                reduced = buf[off : off + p.numel()].view_as(p)
                # The averaged gradient is a view of the bucket: no copy back. The engine drops
                # it (zero_grad) before the bucket is refilled by the next boundary's backward.
                p.grad = reduced if reduced.dtype == p.dtype else reduced.to(p.dtype)
            bucket.work = None
        self.armed = False

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
