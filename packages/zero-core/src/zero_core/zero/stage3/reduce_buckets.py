"""Bucketed, ordered, overlapped reduce-scatter of stage-3 gradients into each rank's shard.

[Note: stage 3 gradient buckets]
A parameter's full gradient is complete when its post-accumulate-grad hook fires (see
[Note: stage 3 hooks]). Reducing each one with its own ``reduce_scatter_tensor`` costs one
collective (plus its agreement check) per parameter, and on gloo the per-collective latency
dominates for small tensors. Instead the hook hands the gradient to :class:`GradBucketReducer`,
which holds it until about ``reduce_bucket_size`` elements are waiting and then launches one
asynchronous reduce-scatter for all of them, while autograd goes on computing the gradients
of earlier layers.

Layout of one bucket (N ranks, parameters p1..pk with shard sizes s1..sk): a contiguous
buffer of shape ``(N, s1 + ... + sk)`` whose row r holds chunk r of every parameter's padded
flat gradient, side by side. ``reduce_scatter_tensor`` hands rank r the sum of row r over the
ranks, which is exactly its shard of every parameter in the bucket, contiguous. The buffer
has the gradients' dtype, or ``communication_data_type`` when the config sets one (fp32
reductions of bf16/fp16 gradients, as in stages 0-2), and is divided by N before the sum (keeps
fp16 in range; exact for power-of-two N), as stages 1 and 2 do (see
[Note: partitioned gradient reduction]); expert parameters are divided by the
whole data-parallel world size instead (their ``grad_divisor``; see
[Note: stage 3 expert parameters]), and a bucket never mixes parameters of different groups.
Each reduced piece is added into the parameter's ``grad_shard``, kept in the shard's dtype or
in a wider ``accum_dtype`` (See [Note: gradient accumulation dtype] in engine/grad_buckets.py).

Ordering: every rank runs the same backward graph, so the hooks fire in the same order and
buckets are cut at the same parameters; buckets are launched strictly in that order, and
what is left when backward ends is launched by :meth:`flush`. The agreement check of
[Note: stage 3 collective agreement] runs once per bucket, naming its first parameters.
At most ``max_in_flight`` buckets are in flight (older ones are completed first), which
bounds the full-size gradient bytes alive to about ``(max_in_flight + 1) * reduce_bucket_size``.
The gradients a rank held are dropped as soon as they are copied into a bucket buffer.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from zero_core import comm
from zero_core.zero.stage3.collective_agreement import wait_bounded
from zero_core.zero.stage3.param_records import RECORDS_BY_ID as _BY_ID
from zero_core.zero.stage3.partitioned_param import check_agreement, param_name
from zero_core.zero.stage3.shard_groups import reduce_across_replicas
from zero_core.zero.stage3.streams import stage3_streams


def _copy_rows(dst: torch.Tensor, flat: torch.Tensor, shard: int) -> None:
    """Write the zero-padded ``flat`` (numel <= rows * shard) into ``dst`` of shape (rows, shard)."""
    n = flat.numel()
    rows = dst.shape[0]
    full = n // shard
    if full:
        dst[:full].copy_(flat[: full * shard].view(full, shard))
    if full < rows:
        rest = n - full * shard
        if rest:
            dst[full, :rest].copy_(flat[full * shard :])
        dst[full, rest:].zero_()
        dst[full + 1 :].zero_()


class _Bucket:
    __slots__ = ("params", "offsets", "total", "out", "work", "what", "buffer")

    def __init__(self) -> None:
        self.params: list[torch.nn.Parameter] = []
        self.offsets: list[int] = []
        self.total = 0  # elements per row (sum of shard sizes)
        self.out: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self.work: Any = None
        self.what = ""


class GradBucketReducer:
    """Collects full gradients into buckets and reduce-scatters them; see the Note above."""

    def __init__(
        self,
        bucket_numel: int,
        *,
        overlap: bool = True,
        max_in_flight: int = 2,
        comm_dtype: torch.dtype | None = None,
        accum_dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(
                f"GradBucketReducer: reduce_bucket_size must be an int >= 1, got {bucket_numel!r}"
            )
        if max_in_flight < 1:
            raise ValueError(f"GradBucketReducer: max_in_flight must be >= 1, got {max_in_flight}")
        if comm_dtype is not None and comm_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"GradBucketReducer: comm_dtype must be a float dtype or None, got {comm_dtype!r}"
            )
        self.bucket_numel = bucket_numel
        self.overlap = bool(overlap)
        # ``communication_data_type``: buckets are reduced in this dtype (None: the gradients')
        self.comm_dtype = comm_dtype
        # the dtype gradient shards sum the micro-steps in (None: the shard's own)
        self.accum_dtype = accum_dtype
        self.max_in_flight = max_in_flight
        self._grads: list[torch.Tensor] = []  # gradients of the bucket being filled
        self._filling = _Bucket()
        self._filling_numel = 0
        self._in_flight: deque[_Bucket] = deque()
        self.launched = 0  # buckets launched since construction (tests and benchmarks read it)
        # ``on_reduced(params)`` after a bucket's pieces are accumulated into the params'
        # ``grad_shard`` (optimizer offload stages them to host memory there, overlapped with the
        # rest of backward; See [Note: gradient staging] in zero_offload). None: nothing to do.
        self.on_reduced: Any = None
        # ZeRO++ qgZ: ``qgz(out, rows, group)`` starts a quantized reduce-scatter instead (a
        # ``zero_core.comm.quantized_collectives.QgzReducer``). See [Note: quantized gradient
        # reduce-scatter (qgZ)]. None: plain reduce-scatter.
        self.qgz: Any = None

    # -- filling --------------------------------------------------------------------------
    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Take ownership of ``param``'s complete full gradient (it must not be modified after)."""
        st = _BY_ID[id(param)]
        b = self._filling
        if b.params:
            first = _BY_ID[id(b.params[0])]
            if (
                self._grads[0].dtype != grad.dtype
                or first.group is not st.group
                or first.world != st.world
                or first.grad_divisor != st.grad_divisor  # See [Note: stage 3 expert parameters]
            ):
                self.flush()
                b = self._filling
        b.params.append(param)
        b.offsets.append(b.total)
        b.total += st.shard_numel
        self._grads.append(grad)
        self._filling_numel += st.padded_numel
        if self._filling_numel >= self.bucket_numel:
            self.flush()

    def flush(self) -> None:
        """Launch the bucket being filled (if any); collective in launch order on every rank."""
        b = self._filling
        if not b.params:
            return
        grads = self._grads
        self._filling, self._grads, self._filling_numel = _Bucket(), [], 0
        st0 = _BY_ID[id(b.params[0])]
        world = st0.world
        dtype, device = self.comm_dtype or grads[0].dtype, grads[0].device
        names = [param_name(p) for p in b.params[:4]]
        more = f" and {len(b.params) - 4} more" if len(b.params) > 4 else ""
        b.what = f"reduce-scatter of the gradients of {names}{more}"
        self.launched += 1
        with stage3_streams().reduce_scatter_issue(grads):  # See [Note: stage-3 streams]
            buf = torch.empty(world, b.total, dtype=dtype, device=device)  # copies below cast into it
            for p, off, g in zip(b.params, b.offsets, grads):
                sn = _BY_ID[id(p)].shard_numel
                _copy_rows(buf[:, off : off + sn], g.reshape(-1), sn)
            grads.clear()  # the full gradients are in the buffer now: free them
            if st0.grad_divisor != 1:
                # the group size, or the data-parallel world size for experts even when their
                # expert-data-parallel group is a single rank (See [Note: stage 3 expert parameters])
                buf.div_(st0.grad_divisor)
            if world == 1:
                b.out = buf.view(-1)
            else:
                check_agreement(1, b.params, buf.numel() * buf.element_size(), st0.group, b.what)
                b.out = torch.empty(b.total, dtype=dtype, device=device)
                b.buffer = buf
                if self.qgz is not None:  # ZeRO++ qgZ: See [Note: quantized gradient reduce-scatter (qgZ)]
                    b.work = self.qgz(b.out, buf, st0.group)
                else:
                    b.work = comm.reduce_scatter_tensor(b.out, buf.view(-1), group=st0.group, async_op=True)
        self._in_flight.append(b)
        if not self.overlap or len(self._in_flight) > self.max_in_flight:
            self._complete(self._in_flight.popleft())

    # -- completion -----------------------------------------------------------------------
    def _complete(self, b: _Bucket) -> None:
        work = b.work  # the compute stream waits for it: See [Note: stage-3 streams]
        stage3_streams().reduce_scatter_wait(lambda: work is None or wait_bounded(work, b.what), [b.out])
        out = b.out
        assert out is not None
        # MiCS: the shard group's sum, then over the replicas (See [Note: MiCS and hpZ shard groups])
        reduce_across_replicas(out, _BY_ID[id(b.params[0])].route, b.what)
        for p, off in zip(b.params, b.offsets):
            st = _BY_ID[id(p)]
            piece = out[off : off + st.shard_numel]
            if st.grad_shard is None:
                st.grad_shard = piece.to(self.accum_dtype or st.shard.dtype, copy=True)
            else:
                st.grad_shard.add_(piece)
        if self.on_reduced is not None:
            self.on_reduced(b.params)
        b.buffer = b.out = b.work = None

    def finish(self) -> None:
        """Launch what is left, wait for every bucket and accumulate into the gradient shards."""
        self.flush()
        while self._in_flight:
            self._complete(self._in_flight.popleft())

    def live_bytes(self) -> int:
        """Full-size gradient bytes held right now (waiting gradients and in-flight buffers)."""
        total = sum(g.numel() * g.element_size() for g in self._grads)
        for b in self._in_flight:
            if b.buffer is not None:
                total += b.buffer.numel() * b.buffer.element_size()
        return total
