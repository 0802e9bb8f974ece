"""Point-to-point transfer of activations and gradients between neighbouring stages.

[Note: p2p metadata handshake]
A stage's output may be one tensor or a tuple of tensors; shapes and dtypes are exchanged the
first time a channel is used (a length, then an int64 description), then cached on both ends:
later transfers move only the payload. ``reset_activation_shape()`` on both ends forgets the
cache (e.g. when curriculum learning changes the sequence length). Gloo cannot send bool
tensors, so they travel as uint8 and are turned back into bool on arrival.

[Note: dynamic activation shapes]
With ``PipelineModule(dynamic_shape=True)`` (DeepSpeed's option for inputs whose shapes vary
between micro-batches, e.g. unpadded sequences) a channel is *dynamic*: every send carries the
handshake's description ahead of its payload and every receive reads it first, so nothing is
cached and no receive is posted before its description arrived (the executor does not prefetch
activations then). Gradients need no description: they have the shapes of the activations the
receiver itself sent for that micro-batch.

[Note: asynchronous p2p]
Payloads move with ``isend``/``irecv``. A send never blocks the sender: it returns a
:class:`PendingSend` that keeps the tensors alive until the transfer is done, so the stage goes
on computing while the transport drains it. A receive can be *posted* long before its data is
needed (:class:`PendingRecv`), so the bytes land while the receiver computes, and ``wait()`` at
the instruction costs nothing when they already arrived. Messages between two ranks are matched
in posting order per tag, and a rank pair may carry several streams at once (interleaved
schedules send activations of one chunk and gradients of another over the same pair), so every
stream has its own tag: see ``activation_tag``/``grad_tag``. The first-use handshake goes out
with ``isend`` too (its two small tensors travel ahead of the payload on the channel's own tag,
and the :class:`PendingSend` keeps them alive), so no send of a channel ever blocks: the engine
may issue a send wherever its data is ready (see [Note: sends right after their compute] in
``stream.py``). Only the receiving end of the handshake blocks, like any wait for data, before
any payload receive of its channel is posted. Gloo moves a message only once both ends posted
it, so a send's work completes only after the peer posted the matching receive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_pipe import _dist

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate a tensor: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Payload:
    """The description of one message: its tensors and whether it was a tuple."""

    metas: tuple[TensorMeta, ...]
    is_tuple: bool

    def floating(self) -> tuple[TensorMeta, ...]:
        """The metas of the floating tensors (those that carry gradients back)."""
        return tuple(m for m in self.metas if m.dtype.is_floating_point)


def activation_tag(boundary: int) -> int:
    """Tag of the activations crossing virtual-stage boundary ``boundary -> boundary + 1``."""
    return 2 * boundary


def grad_tag(boundary: int) -> int:
    """Tag of the gradients crossing virtual-stage boundary ``boundary + 1 -> boundary``."""
    return 2 * boundary + 1


def as_tensors(value: object, where: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    """Normalise a stage output to ``(tensors, was_tuple)``; anything else is a clear error."""
    if isinstance(value, torch.Tensor):
        return (value,), False
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value), True
    raise TypeError(
        f"{where}: a stage must output a tensor or a non-empty tuple of tensors, got {type(value)}"
    )


def _device() -> torch.device:
    """Where stages exchange tensors: the accelerator's current device (NCCL sends GPU tensors
    only; gloo: the CPU). See [Note: collective tensors live on the backend's device]."""
    from zero_core.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _encode(tensors: tuple[torch.Tensor, ...], is_tuple: bool) -> list[int]:
    desc = [len(tensors), int(is_tuple)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"p2p: dtype {t.dtype} cannot be sent between stages; supported: {_DTYPES}")
        desc += [_CODE[t.dtype], t.dim(), *t.shape]
    return desc


def _decode(desc: list[int]) -> Payload:
    n, is_tuple = desc[0], bool(desc[1])
    pos, metas = 2, []
    for _ in range(n):
        code, ndim = desc[pos], desc[pos + 1]
        metas.append(TensorMeta(tuple(desc[pos + 2 : pos + 2 + ndim]), _DTYPES[code]))
        pos += 2 + ndim
    return Payload(tuple(metas), is_tuple)


def _wire(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.contiguous()


class PendingSend:
    """Sends in flight; holds their tensors until they are done (see [Note: asynchronous p2p])."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self._works = works
        self._tensors = tensors

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works, self._tensors = [], []


class PendingRecv:
    """Receives posted into fresh buffers; ``wait()`` returns the value (tensor or tuple)."""

    def __init__(self, works: list, buffers: list[torch.Tensor], payload: Payload) -> None:
        self._works = works
        self._buffers = buffers
        self.payload = payload

    def wait(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        for w in self._works:
            w.wait()
        out = [
            buf.to(torch.bool) if meta.dtype == torch.bool else buf
            for buf, meta in zip(self._buffers, self.payload.metas)
        ]
        return tuple(out) if self.payload.is_tuple else out[0]


def post_send(
    tensors: tuple[torch.Tensor, ...] | list[torch.Tensor],
    peer: int,
    tag: int,
    *,
    preamble: tuple[torch.Tensor, ...] = (),
) -> PendingSend:
    """Start sending ``preamble`` (as is) then ``tensors`` (in order) to global rank ``peer`` on ``tag``."""
    wires = [*preamble, *(_wire(t) for t in tensors)]
    return PendingSend([_dist.isend(w, peer, tag=tag) for w in wires], wires)


def post_recv(payload: Payload, peer: int, tag: int) -> PendingRecv:
    """Post receives for a message described by ``payload`` from global rank ``peer`` on ``tag``."""
    bufs = [
        torch.empty(m.shape, dtype=torch.uint8 if m.dtype == torch.bool else m.dtype, device=_device())
        for m in payload.metas
    ]
    return PendingRecv([_dist.irecv(b, peer, tag=tag) for b in bufs], bufs, payload)


class P2PChannel:
    """A one-way stream of activations to or from one peer rank on one tag, caching the
    payload description (see [Note: p2p metadata handshake])."""

    def __init__(self, peer: int, tag: int = 0, *, dynamic: bool = False) -> None:
        self.peer = peer
        self.tag = tag
        #: describe every message: See [Note: dynamic activation shapes]
        self.dynamic = dynamic
        self.payload: Payload | None = None

    def reset(self) -> None:
        """Forget the payload description; the next transfer shakes hands again."""
        self.payload = None

    def isend(self, value: object) -> PendingSend:
        """Start sending ``value``, preceded on first use by the handshake; never blocks."""
        tensors, is_tuple = as_tensors(value, "SendActivation")
        preamble: tuple[torch.Tensor, ...] = ()
        if self.payload is None or self.dynamic:
            desc = _encode(tensors, is_tuple)  # built on the host: decoded without a device read
            preamble = (
                torch.tensor([len(desc)], dtype=torch.int64, device=_device()),
                torch.tensor(desc, dtype=torch.int64, device=_device()),
            )
            self.payload = _decode(desc)
        elif len(tensors) != len(self.payload.metas) or any(
            t.dtype != m.dtype or tuple(t.shape) != m.shape for t, m in zip(tensors, self.payload.metas)
        ):
            now = tuple(TensorMeta(tuple(t.shape), t.dtype) for t in tensors)
            raise ValueError(
                f"p2p: activation shapes/dtypes changed from {self.payload.metas} to {now}; "
                "call reset_activation_shape() on every rank when they change"
            )
        return post_send(tensors, self.peer, self.tag, preamble=preamble)

    def send(self, value: object) -> None:
        """Send ``value`` and wait until the transport is done with it."""
        self.isend(value).wait()

    def irecv(self) -> PendingRecv:
        """Post the receive of the next value; shakes hands (blocking) on first use, or on every
        use for a dynamic channel."""
        if self.payload is None or self.dynamic:
            # the handshake's two host reads happen once per channel (every transfer if dynamic)
            length = torch.zeros(1, dtype=torch.int64, device=_device())
            _dist.recv(length, self.peer, tag=self.tag)
            desc = torch.zeros(int(length.item()), dtype=torch.int64, device=_device())
            _dist.recv(desc, self.peer, tag=self.tag)
            self.payload = _decode(desc.tolist())
        return post_recv(self.payload, self.peer, self.tag)

    def recv(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Receive the next value (blocking)."""
        return self.irecv().wait()


def send_grads(grads: list[torch.Tensor], peer: int, tag: int = 1) -> None:
    """Send gradients whose shapes the receiver knows (they match what it sent us); blocking."""
    post_send(grads, peer, tag).wait()


def recv_grads(metas: list[TensorMeta], peer: int, tag: int = 1) -> list[torch.Tensor]:
    """Receive one gradient per meta (blocking)."""
    value = post_recv(Payload(tuple(metas), True), peer, tag).wait()
    return list(value)
