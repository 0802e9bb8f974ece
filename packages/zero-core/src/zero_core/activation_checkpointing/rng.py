"""RNG state tracking for activation checkpointing and model parallelism.

[Note: which generator the tracker tracks]
The tracker keeps named states of the generator that produces the activations' randomness (dropout): the
current CUDA device's generator when CUDA is available, else the CPU default generator. The class keeps
DeepSpeed's name ``CudaRNGStatesTracker`` because users know it, but on a CPU-only machine it tracks CPU
states, so that ``with get_cuda_rng_tracker().fork():`` gives model-parallel dropout its own stream there too.
A checkpoint captures every generator state (CPU, CUDA when present, and each tracked state) at forward
and restores them around the recompute, so dropout masks of the recompute equal those of the forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"

# Offset between the data-parallel seed and the model-parallel seeds (any constant unlikely to collide
# with seeds users pick works; this one is the value Megatron-style codebases use).
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _device_get_state() -> torch.Tensor:
    if torch.cuda.is_available():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _device_set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _device_manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named RNG states of the activation device. See [Note: which generator the tracker tracks].

    ``add(name, seed)`` creates a state seeded with ``seed``; ``fork(name)`` runs a block with that state
    and keeps the advanced state for next time, leaving the surrounding state untouched.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every tracked state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the tracked states (name -> generator state)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the tracked states (used to restore them after a recompute)."""
        if not isinstance(states, dict) or not all(isinstance(s, torch.Tensor) for s in states.values()):
            raise TypeError("CudaRNGStatesTracker.set_states: expected a dict of name -> RNG state tensor")
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Track a new state called ``name`` seeded with ``seed`` (both must be unused)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"CudaRNGStatesTracker.add: name must be a non-empty str, got {name!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"CudaRNGStatesTracker.add: seed must be an int, got {seed!r}")
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: RNG state '{name}' already exists")
        self.seeds_.add(seed)
        outer = _device_get_state()
        _device_manual_seed(seed)
        self.states_[name] = _device_get_state()
        _device_set_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with the tracked state ``name``; restore the outer state afterwards."""
        if name not in self.states_:
            raise KeyError(
                f"CudaRNGStatesTracker.fork: RNG state '{name}' is not added (known: {list(self.states_)})"
            )
        outer = _device_get_state()
        _device_set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _device_get_state()
            _device_set_state(outer)


RNGStatesTracker = CudaRNGStatesTracker

_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide RNG tracker used by checkpointing and model-parallel layers."""
    return _TRACKER


def seed_model_parallel(seed: int, model_parallel_rank: int) -> None:
    """Seed the default generator with ``seed`` and restart the tracked ``model-parallel-rng``
    state at ``seed + 2718 + model_parallel_rank``; the public entry, which finds the rank from
    the model-parallel unit, is ``checkpointing.model_parallel_cuda_manual_seed``."""
    _TRACKER.reset()
    _device_manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _MODEL_PARALLEL_SEED_OFFSET + model_parallel_rank)


@dataclasses.dataclass
class RNGSnapshot:
    """Every generator state a checkpointed region can draw from."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls) -> RNGSnapshot:
        cuda = torch.cuda.get_rng_state() if _cuda_in_use() else None
        return cls(torch.get_rng_state(), cuda, _TRACKER.get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        _TRACKER.set_states(self.tracker)
