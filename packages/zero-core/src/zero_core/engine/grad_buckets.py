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
only some ranks used is averaged with zeros from the others.

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

Scaling (DeepSpeed's ``prescale_gradients`` and ``gradient_predivide_factor``): by default the
buffer is divided by ``gradient_predivide_factor`` before the sum and by ``world /
predivide`` after it; with ``prescale`` it is divided by the world size before the sum and not
after, which keeps fp16 sums in range (the order of operations is visible in fp16: N values
near the fp16 maximum overflow when summed first). See [Note: gradient accumulation dtype]
for ``accum_dtype``.

[Note: gradient accumulation dtype]
``data_types.grad_accum_dtype`` names the dtype gradients are summed in across the micro-steps
of an accumulation boundary. When it is the training dtype (the default) autograd accumulates
into ``param.grad`` as usual. When it is wider (fp32 with bf16/fp16 training) each micro-step's
gradient is added, from its post-accumulate-grad hook, into an fp32 slot and ``param.grad`` is
freed, as DeepSpeed does (its ``grad_accum`` attribute at stage 1, its bf16 optimizer's fp32
gradients at stages 0-1); the sum is therefore exactly the fp32 sum of the 16-bit micro-step
gradients. Where the sum lives per stage: stage 0 in these bucket buffers (reduced once at the
boundary), stage 1 in the flat gradient buffer (``zero/grad_reduce.py``), stage 2 in the
reduced gradient shard and stage 3 in each parameter's ``grad_shard`` (both reduce every
micro-step and add the reduced piece into the wider sum). The step reads the wide sum directly.
The reductions run in ``communication_data_type`` when it is set, else in the dtype of what is
reduced: the wide sums at stages 0-1 (so the boundary's gradient is exactly the reduced fp32
sum), each micro-step's 16-bit gradients at stages 2-3. DeepSpeed casts stage 0-1's fp32 sums
to its communication dtype, which defaults to the model's: set ``"communication_data_type":
"bf16"`` (or ``"fp16"``) for its bytes on the wire. (DeepSpeed 0.19 serves fp32 accumulation
with its bf16 optimizer at stage 1 and in pipelines, its ZeRO optimizers at stages 1-3, and
refuses it at stage 0; zero has it at stages 0-3, and refuses it in pipelines.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zero_core import comm
from zero_core.comm.work import Work

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
    work: Work | None = None
    had_grad: list[bool] = field(default_factory=list)  # this rank's, at the last launch
    accumulated: set[int] = field(default_factory=set)  # params summed into the buffer (accum_dtype)
    send: torch.Tensor | None = None  # the buffer cast to the communication dtype, in flight


class BucketedAllReduce:
    """Averages ``.grad`` of ``params`` over ``group`` in ordered, overlapped buckets."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        bucket_numel: int,
        group: dist.ProcessGroup | None = None,
        overlap: bool = True,
        comm_dtype: torch.dtype | None = None,
        predivide_factor: float = 1.0,
        divisor: int | None = None,
        prescale: bool = False,
        accum_dtype: torch.dtype | None = None,
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
        self.prescale = bool(prescale)  # See the scaling paragraph of [Note: gradient buckets]
        # None: autograd accumulates in param.grad; else See [Note: gradient accumulation dtype]
        self.accum_dtype = accum_dtype
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
        b, i = self._where[id(param)]
        if self.accum_dtype is not None:
            self._accumulate(self.buckets[b], i, param)
        if not self.armed:
            return
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

    def _accumulate(self, bucket: _Bucket, i: int, param: torch.nn.Parameter) -> None:
        """Add ``param``'s micro-step gradient into its ``accum_dtype`` slot and free it."""
        buf = bucket.buffer
        if buf is None:  # allocated once: See [Note: gradient accumulation dtype]
            n = len(bucket.params)
            buf = torch.empty(bucket.numel + n, dtype=self.accum_dtype, device=bucket.params[0].device)
            bucket.buffer = buf
        off, p = bucket.offsets[i], bucket.params[i]
        dst, g = buf[off : off + p.numel()], param.grad.reshape(-1)
        if i in bucket.accumulated:
            dst.add_(g)
        else:
            dst.copy_(g)
            bucket.accumulated.add(i)
        param.grad = None

    def accumulated_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """With ``accum_dtype``: ``param``'s summed (after ``finish``, reduced) gradient, a view of
        its bucket; None when no micro-step produced one."""
        b, i = self._where[id(param)]
        bucket = self.buckets[b]
        if i not in bucket.accumulated or bucket.buffer is None:
            return None
        off = bucket.offsets[i]
        return bucket.buffer[off : off + param.numel()].view_as(param)

    def zero_grad(self) -> None:
        """Start a new sum (``accum_dtype``): the next micro-step's gradients overwrite the slots."""
        for b in self.buckets:
            b.accumulated.clear()

    def _launch(self, bucket: _Bucket) -> None:
        if self.accum_dtype is not None:
            self._launch_accumulated(bucket)
            return
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
            elif g.data_ptr() != dst.data_ptr():  # not already this slot (see finish())
                dst.copy_(g.reshape(-1))
        bucket.had_grad = [g is not None for g in grads]
        buf[bucket.numel :] = torch.tensor(bucket.had_grad, dtype=dtype)
        self._prescale(buf, bucket.numel)
        bucket.launched = True
        bucket.work = comm.all_reduce(buf, group=self.group, async_op=True)

    def _prescale(self, buf: torch.Tensor, numel: int) -> None:
        """The division before the sum: by the world size (``prescale``) or the predivide factor."""
        div = self.world_size if self.prescale else self.predivide_factor
        if div != 1:
            buf[:numel].div_(div)

    def _launch_accumulated(self, bucket: _Bucket) -> None:
        """Reduce a bucket's wide sums (in the communication dtype, copied back in ``finish``)."""
        buf = bucket.buffer
        if buf is None:  # no micro-step produced a gradient here: a zero bucket all the same
            buf = bucket.buffer = torch.zeros(
                bucket.numel + len(bucket.params), dtype=self.accum_dtype, device=bucket.params[0].device
            )
        for i, (p, off) in enumerate(zip(bucket.params, bucket.offsets)):
            if i not in bucket.accumulated:
                buf[off : off + p.numel()].zero_()
        bucket.had_grad = [i in bucket.accumulated for i in range(len(bucket.params))]
        buf[bucket.numel :] = torch.tensor(bucket.had_grad, dtype=buf.dtype)
        self._prescale(buf, bucket.numel)
        send = buf if self.comm_dtype in (None, buf.dtype) else buf.to(self.comm_dtype)
        bucket.send = send if send is not buf else None
        bucket.launched = True
        bucket.work = comm.all_reduce(send, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch what is left, wait for every bucket and write the averaged gradients back."""
        if not self.armed:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        post = 1.0 if self.prescale else self.world_size / self.predivide_factor
        for bucket in self.buckets:
            bucket.work.wait()
            buf = bucket.buffer
            assert buf is not None
            if bucket.send is not None:
                buf.copy_(bucket.send)
                bucket.send = None
            if post != 1.0:
                buf[: bucket.numel].div_(post)
            # Which parameters got a gradient on some rank: a host read, needed only when this
            # rank lacks one (with a local gradient the count is >= 1), so the usual step has none.
            # See [Note: scalars stay on the device in the step].
            local = bucket.had_grad
            counts = [1] * len(bucket.params) if all(local) else buf[bucket.numel :].tolist()
            for i, (p, off, count) in enumerate(zip(bucket.params, bucket.offsets, counts)):
                if count == 0:
                    p.grad = None
                    bucket.accumulated.discard(i)
                    continue
                if self.accum_dtype is not None:  # the step reads the wide sum: accumulated_grad()
                    bucket.accumulated.add(i)
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
