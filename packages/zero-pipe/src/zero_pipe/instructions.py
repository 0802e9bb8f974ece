"""The instructions a pipeline schedule yields and a pipeline engine executes.

An instruction is a small record (keyword arguments become attributes, like a namedtuple).
Buffer instructions name a pipeline buffer (``buffer_id``) and, for interleaved schedules,
the model chunk (``chunk_id``, 0 when a stage holds one chunk).
"""

from __future__ import annotations


class PipeInstruction:
    """Base class of every instruction; keyword arguments are stored as attributes."""

    def __init__(self, **kwargs: object) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, val in kwargs.items():
            setattr(self, key, val)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after ``ReduceGrads``/``ReduceTiedGrads``)."""


class ReduceGrads(PipeInstruction):
    """All-reduce (average) the gradients among the data-parallel replicas of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """All-reduce the gradients of tied weights among the stages that share them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction operating on one pipeline buffer."""

    def __init__(self, buffer_id: int, **kwargs: object) -> None:
        if not isinstance(buffer_id, int) or buffer_id < 0:
            raise ValueError(f"{type(self).__name__}: buffer_id must be an int >= 0, got {buffer_id!r}")
        kwargs.setdefault("chunk_id", 0)
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Load the next micro-batch into a buffer (inputs on the first stage, labels on the last)."""


class ForwardPass(BufferOpInstruction):
    """Run the forward pass of the buffer's inputs (and the loss on the last stage)."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate the buffer's output gradients (or loss) and accumulate parameter gradients."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage (asynchronous; paired with ``RecvActivation``)."""


class RecvActivation(BufferOpInstruction):
    """Receive the buffer's inputs from the previous stage (waits for them; paired with ``SendActivation``)."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the buffer's inputs to the previous stage (paired with ``RecvGrad``)."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the buffer's outputs from the next stage (paired with ``SendGrad``)."""
