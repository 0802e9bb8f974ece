"""Side streams of ZeRO stage 3: all-gathers and reduce-scatters overlap with compute.

[Note: stage-3 streams]
On a GPU, work queued on one stream runs in order, and work on two streams may run
concurrently. Stage 3 keeps three: the *compute* stream (whatever stream is current when the
model runs; autograd's, during backward), an *all-gather* stream and a *reduce-scatter*
stream, as FSDP2 does (torch.distributed.fsdp's ``fully_shard``). The rules, and why:

* **All-gather** (:meth:`Stage3Streams.all_gather_issue`, :meth:`Stage3Streams.all_gather_wait`).
  Before packing the shards, the all-gather stream waits on the compute stream: the shards were
  last written there (the optimizer step, a fetch of offloaded shards). The packing copies and
  the collective are queued on the all-gather stream, so a prefetch does not sit behind the
  compute queued after it and the packing copies do not delay compute. When a module needs the
  parameters, the wait on the collective is issued on the all-gather stream (NCCL: that stream
  waits on the communicator's stream), an event is recorded there and the compute stream waits
  on that event before the copy-out into the parameters' gather buffers, which runs on the
  compute stream that uses them.
* **Reduce-scatter** (:meth:`Stage3Streams.reduce_scatter_issue`,
  :meth:`Stage3Streams.reduce_scatter_wait`). Before reading a bucket's gradients the
  reduce-scatter stream waits on the compute stream (autograd produced them there); packing,
  dividing and the collective run on the reduce-scatter stream while autograd computes the
  gradients of earlier layers. Accumulating the reduced shard into ``grad_shard`` happens on
  the compute stream after it waits on an event recorded on the reduce-scatter stream behind
  the collective, so the optimizer (also on the compute stream) reads finished values.
* **Memory crossing streams.** A block freed by the caching allocator is handed out again in
  the order of the stream it was allocated on, regardless of other streams still using it. So
  every tensor used on a stream other than its own is ``record_stream``-ed for that stream
  before its last reference goes: the full gradients (made on compute, read on reduce-scatter),
  the offloaded shards (fetched on compute, packed on all-gather) and the receive/output buffers
  (made on the side stream, read on compute by the copy-out or the accumulation).

On the CPU every stream and event of the accelerator is a no-op (see [Note: CPU accelerator
semantics]), so the same code runs synchronously in program order; the ordering above is
checked on CPU by a test whose accelerator records every wait, record and operation per stream.
Waiting on a collective does not block the host on NCCL (see [Note: collective watchdog]), so
the host keeps queuing compute while the communication runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from zero_core.accelerator import get_accelerator
from zero_core.protocols.accelerator import Accelerator
from zero_core.zero.stage3.runtime_context import stage3_context


class Stage3Streams:
    """The all-gather and reduce-scatter streams of one accelerator (see [Note: stage-3 streams])."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.all_gather = accelerator.Stream()
        self.reduce_scatter = accelerator.Stream()

    @contextmanager
    def _side(self, stream: Any, crossing: Iterable[torch.Tensor]) -> Iterator[None]:
        acc = self.accelerator
        stream.wait_stream(acc.current_stream())  # what compute queued so far is what we read
        for t in crossing:  # made on compute, read on ``stream``: See [Note: stage-3 streams]
            acc.record_stream(t, stream)
        with acc.stream(stream):
            yield

    def all_gather_issue(self, crossing: Iterable[torch.Tensor] = ()) -> Any:
        """Context for packing the shards and issuing an all-gather on the all-gather stream;
        ``crossing``: compute-stream tensors read there that may be freed afterwards."""
        return self._side(self.all_gather, crossing)

    def reduce_scatter_issue(self, crossing: Iterable[torch.Tensor] = ()) -> Any:
        """Context for packing gradients (``crossing``) and issuing a reduce-scatter on the
        reduce-scatter stream."""
        return self._side(self.reduce_scatter, crossing)

    def _wait(self, stream: Any, wait: Callable[[], None], results: Iterable[torch.Tensor | None]) -> None:
        acc = self.accelerator
        with acc.stream(stream):
            wait()  # NCCL: ``stream`` waits on the collective; gloo: the host waits
            event = stream.record_event()
        compute = acc.current_stream()
        compute.wait_event(event)
        for t in results:  # made on the side stream, read on compute from here on
            if t is not None:
                acc.record_stream(t, compute)

    def all_gather_wait(self, wait: Callable[[], None], results: Iterable[torch.Tensor | None] = ()) -> None:
        """Make the compute stream wait for an all-gather (``wait`` waits on its work)."""
        self._wait(self.all_gather, wait, results)

    def reduce_scatter_wait(
        self, wait: Callable[[], None], results: Iterable[torch.Tensor | None] = ()
    ) -> None:
        """Make the compute stream wait for a reduce-scatter (``wait`` waits on its work)."""
        self._wait(self.reduce_scatter, wait, results)


def stage3_streams() -> Stage3Streams:
    """The process's stage-3 streams, made for the current accelerator on first use (and again
    when ``set_accelerator`` changed it)."""
    acc = get_accelerator()
    ctx = stage3_context()  # See [Note: stage 3 runtime context]
    streams = ctx.streams
    if streams is None or streams.accelerator is not acc:
        streams = ctx.streams = Stage3Streams(acc)
    return streams
