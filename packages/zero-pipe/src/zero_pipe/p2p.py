"""Point-to-point transfer of activations and gradients between neighbouring stages.

[Note: p2p metadata handshake]
A stage's output may be one tensor or a tuple of tensors; shapes and dtypes are exchanged the
first time a channel is used (a length, then an int64 description), then cached on both ends:
later transfers move only the payload. ``reset_activation_shape()`` on both ends forgets the
cache (e.g. when curriculum learning changes the sequence length). Gloo cannot send bool
tensors, so they travel as uint8 and are turned back into bool on arrival.
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


def as_tensors(value: object, where: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    """Normalise a stage output to ``(tensors, was_tuple)``; anything else is a clear error."""
    if isinstance(value, torch.Tensor):
        return (value,), False
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value), True
    raise TypeError(
        f"{where}: a stage must output a tensor or a non-empty tuple of tensors, got {type(value)}"
    )


def _encode(tensors: tuple[torch.Tensor, ...], is_tuple: bool) -> torch.Tensor:
    desc = [len(tensors), int(is_tuple)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"p2p: dtype {t.dtype} cannot be sent between stages; supported: {_DTYPES}")
        desc += [_CODE[t.dtype], t.dim(), *t.shape]
    return torch.tensor(desc, dtype=torch.int64)


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


class P2PChannel:
    """A one-way channel to or from one peer rank, caching the payload description."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.payload: Payload | None = None

    def reset(self) -> None:
        """Forget the payload description; the next transfer shakes hands again."""
        self.payload = None

    def send(self, value: object) -> None:
        tensors, is_tuple = as_tensors(value, "SendActivation")
        if self.payload is None:
            desc = _encode(tensors, is_tuple)
            _dist.send(torch.tensor([desc.numel()], dtype=torch.int64), self.peer)
            _dist.send(desc, self.peer)
            self.payload = _decode(desc.tolist())
        else:
            now = tuple(TensorMeta(tuple(t.shape), t.dtype) for t in tensors)
            if now != self.payload.metas:
                raise ValueError(
                    f"p2p: activation shapes/dtypes changed from {self.payload.metas} to {now}; "
                    "call reset_activation_shape() on every rank when they change"
                )
        for t in tensors:
            _dist.send(_wire(t), self.peer)

    def recv(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.payload is None:
            length = torch.zeros(1, dtype=torch.int64)
            _dist.recv(length, self.peer)
            desc = torch.zeros(int(length.item()), dtype=torch.int64)
            _dist.recv(desc, self.peer)
            self.payload = _decode(desc.tolist())
        out = []
        for meta in self.payload.metas:
            wire_dtype = torch.uint8 if meta.dtype == torch.bool else meta.dtype
            buf = torch.empty(meta.shape, dtype=wire_dtype)
            _dist.recv(buf, self.peer)
            out.append(buf.to(torch.bool) if meta.dtype == torch.bool else buf)
        return tuple(out) if self.payload.is_tuple else out[0]


def send_grads(grads: list[torch.Tensor], peer: int) -> None:
    """Send gradients whose shapes the receiver knows (they match what it sent us)."""
    for g in grads:
        _dist.send(_wire(g), peer)


def recv_grads(metas: list[TensorMeta], peer: int) -> list[torch.Tensor]:
    """Receive one gradient per meta."""
    out = []
    for meta in metas:
        buf = torch.empty(meta.shape, dtype=meta.dtype)
        _dist.recv(buf, peer)
        out.append(buf)
    return out
