"""Base of the flat-buffer optimizer kernels for the ZeRO engine (the FlatOptimizerKernel protocol).

The engine owns flat fp32 partitions (parameters, gradients, optimizer states) and calls
``kernel.step(params, grads, states, *, step, lr, **hparams)`` on them; ``state_names()`` tells it
which state buffers to allocate (fp32, same numel as params; ``init_states`` does it).
zero-ops does not import zero_core: these classes satisfy the protocol by shape (duck typing).

[Note: tiled updates]
``tile_numel`` splits one step into consecutive tiles (e.g. the ZeRO ``sub_group_size``); after
each tile ``on_tile_done(start, end)`` is called, so offload can start copying that tile's
updated (low-precision) parameters to the device while the next tile is computed. Tiling does
not change results: each element's update is independent of the others.

[Note: one update function]
Each optimizer has one function that applies its update to flat fp32 buffers described by a
``_flat.FlatUpdate`` (buffers, state buffers by name, a mapping of hyper-parameters, step, lr,
threads): ``adam_update``, ``adagrad_update``, ``lion_update``, in ``<optimizer>/functional.py``
next to the ``cpu_*_step`` they call. The CPU optimizers (``CPUOptimizerBase``) hand it a param
group as the hyper-parameters, the flat kernels (``FlatKernelBase``) their merged
hyper-parameters, so the two front ends cannot drift apart in how they read one. A subclass only
names the function (``_update_fn``) and its state buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from zero_ops import _flat

TileCallback = Callable[[int, int], None]


class FlatKernelBase:
    """Common part: hyper-parameter merging, state checks, tiling, and ``step``.

    Subclasses set ``_name``, ``_hparam_names``, ``_update_fn`` (see [Note: one update function])
    and define ``state_names()``.
    """

    _name = "kernel"
    _hparam_names: tuple[str, ...] = ()
    _update_fn: Callable[..., None]

    def __init__(self, hparams: dict[str, Any], threads: int | None, tile_numel: int | None) -> None:
        if tile_numel is not None and (
            isinstance(tile_numel, bool) or not isinstance(tile_numel, int) or tile_numel < 1
        ):
            raise ValueError(f"{self._name}: tile_numel must be an int >= 1 or None, got {tile_numel!r}")
        self.hparams = hparams
        self.threads = _flat.optional_threads(self._name, threads)
        self.tile_numel = tile_numel

    def state_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def step(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        states: Mapping[str, torch.Tensor],
        *,
        step: int,
        lr: float,
        low_precision_out: torch.Tensor | None = None,
        on_tile_done: TileCallback | None = None,
        **hparams: object,
    ) -> None:
        """One update of the flat ``params`` (and ``states``) in place, tile by tile (see
        [Note: tiled updates]); ``hparams`` override the constructor's for this call."""
        h = self._merged(hparams)
        self._check_step(step)
        names = self.state_names()
        update = type(self)._update_fn

        def fn(p: torch.Tensor, g: torch.Tensor, *rest: torch.Tensor | None) -> None:
            update(_flat.FlatUpdate(p, g, dict(zip(names, rest[:-1])), rest[-1], h, step, lr, self.threads))

        self._run_tiled(params, grads, self._states(states), low_precision_out, on_tile_done, fn)

    def _check_step(self, step: int) -> None:
        """Validates ``step`` up front, for kernels whose update does not (it checks it itself)."""

    def init_states(self, params: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-filled fp32 state buffers for the flat ``params``."""
        return {k: torch.zeros(params.numel(), dtype=torch.float32) for k in self.state_names()}

    def _merged(self, hparams: dict[str, Any]) -> dict[str, Any]:
        unknown = set(hparams) - set(self._hparam_names)
        if unknown:
            raise TypeError(
                f"{self._name}.step: unknown hyper-parameters {sorted(unknown)}; "
                f"allowed: {list(self._hparam_names)}"
            )
        return {**self.hparams, **hparams}

    def _states(self, states: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        if not isinstance(states, Mapping):
            raise TypeError(f"{self._name}.step: states must be a mapping name -> tensor")
        missing = [k for k in self.state_names() if k not in states]
        if missing:
            raise KeyError(f"{self._name}.step: states lacks {missing}; needed: {list(self.state_names())}")
        return [states[k] for k in self.state_names()]

    def _tiles(self, numel: int) -> list[tuple[int, int]]:
        tile = self.tile_numel or max(numel, 1)
        return [(s, min(numel, s + tile)) for s in range(0, numel, tile)]

    def _run_tiled(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        states: list[torch.Tensor],
        lp_out: torch.Tensor | None,
        on_tile_done: TileCallback | None,
        fn: Callable[..., None],
    ) -> None:
        if not isinstance(params, torch.Tensor) or not isinstance(grads, torch.Tensor):
            raise TypeError(f"{self._name}.step: params and grads must be tensors")
        if on_tile_done is not None and not callable(on_tile_done):
            raise TypeError(f"{self._name}.step: on_tile_done must be callable(start, end)")
        flat = [
            t.view(-1) if isinstance(t, torch.Tensor) and t.is_contiguous() else t
            for t in (params, grads, *states, lp_out)
        ]
        for start, end in self._tiles(params.numel()):
            part = [None if t is None else t[start:end] for t in flat]
            fn(*part)
            if on_tile_done is not None:
                on_tile_done(start, end)
