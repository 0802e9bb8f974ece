"""The CPU Adam step of ``OptimizerOffload`` (a mixin): tiles, fused low-precision cast, copy-back.

``step`` runs zero-ops' CPUAdam over ``sub_group_size`` tiles of every staged master (host
buffers, or the NVMe tile pipeline of [Note: tile pipeline]), writes the updated weights in
the training dtype and, on CUDA, copies each finished tile back to the device while the next
one is computed; ``updated`` and the ``publish`` callback hand those weights to the
strategies (with masters on NVMe only ``publish``, tile by tile: [Note: ZeRO-Infinity streaming]). The attributes used here
are set by ``OptimizerOffload.__init__`` / ``adopt`` / ``finalize``; see
[Note: optimizer offload hook] in optimizer_offload.py.
"""

from __future__ import annotations

import torch
from zero_ops.adam import CPUAdamKernel

from zero_offload.offload_groups import _GRAD, _MASTER, _adam_settings, _Group
from zero_offload.offload_stream import Publish
from zero_offload.transfers import CopyFence


class OffloadStepMixin:
    """The optimizer step path of :class:`~zero_offload.optimizer_offload.OptimizerOffload`."""

    compute_device: torch.device
    tile: int
    groups: list[_Group]
    _where: dict[int, tuple[int, int]]
    _staged: set[int]
    _finalized: bool
    grads_landed: CopyFence
    copied_back: CopyFence
    masters_on_nvme: bool
    low_dtype: torch.dtype

    def _ranges(self, optimizer: torch.optim.Optimizer, grp: _Group) -> list[tuple[int, int, int, list]]:
        """Runs (lo, hi, step, params) of consecutive staged masters sharing one step count."""
        runs: list[tuple[int, int, int, list]] = []
        for i, p in enumerate(grp.params):
            if id(p) not in self._staged:
                continue
            step = int(optimizer.state[p]["step"]) + 1
            lo, hi = grp.offsets[i], grp.offsets[i + 1]
            if runs and runs[-1][1] == lo and runs[-1][2] == step:
                runs[-1] = (runs[-1][0], hi, step, runs[-1][3] + [p])
            else:
                runs.append((lo, hi, step, [p]))
        return runs

    @torch.no_grad()
    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scale: float | torch.Tensor = 1.0,
        publish: Publish | None = None,
    ) -> None:
        """One Adam step of every staged master, on the CPU (see [Note: optimizer offload hook]).

        ``grad_scale`` may be a device tensor (the engine's clip coefficient): it is brought to
        the host once here, where the update runs anyway. ``publish(master, values)`` receives
        every stepped master's updated weights in the training dtype; with masters on NVMe it is
        required and called as soon as a master's last tile is done (See [Note: ZeRO-Infinity
        streaming]), otherwise after the step with :meth:`updated`'s values."""
        if not self._finalized:
            self.finalize(optimizer)
        if self.masters_on_nvme and publish is None:
            raise ValueError(
                "OptimizerOffload.step: with the masters on NVMe the updated weights exist only tile by "
                "tile; pass publish= to receive them"
            )
        self.grads_landed.wait()  # the staged gradients have landed: See [Note: offload copies]
        self._drain_grads()  # and the streamed ones are on disk
        self.copied_back.wait()  # the last step's weights have left the host buffers
        owner = {id(p): (gi, pg) for gi, pg in enumerate(optimizer.param_groups) for p in pg["params"]}
        stepped: list[torch.Tensor] = []
        for grp in self.groups:
            if not grp.params or id(grp.params[0]) not in owner:
                continue
            gi, pg = owner[id(grp.params[0])]
            runs = self._ranges(optimizer, grp)
            if not runs:
                continue
            if isinstance(grad_scale, torch.Tensor):
                grad_scale = grad_scale.to("cpu")  # one copy per step, not per range
            self._step_group(grp, _adam_settings(optimizer, pg, gi), runs, grad_scale, publish)
            for _, _, step, params in runs:
                for p in params:
                    optimizer.state[p]["step"].fill_(float(step))
                stepped += params
        self.copied_back.mark()  # the next host write of these buffers waits for it
        if publish is not None and not self.masters_on_nvme:
            for p in stepped:
                publish(p, self.updated(p))
        self._staged.clear()

    def _step_group(
        self,
        grp: _Group,
        hp: dict,
        runs: list[tuple[int, int, int, list]],
        grad_scale: float | torch.Tensor,
        publish: Publish | None,
    ) -> None:
        """The Adam update of ``runs`` of one group, tile by tile (swapped or in host buffers)."""
        kernel = CPUAdamKernel(
            betas=hp["betas"],
            eps=hp["eps"],
            weight_decay=hp["weight_decay"],
            adamw_mode=hp["adamw_mode"],
            bias_correction=hp["bias_correction"],
            amsgrad=hp["amsgrad"],
        )
        scaled = isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0
        if scaled and not self.masters_on_nvme:  # host gradients (streamed ones: per tile below)
            for lo, hi, _, _ in runs:
                grp.grad[lo:hi].mul_(grad_scale)
        low_tile = None
        if self.masters_on_nvme and self.low_dtype != torch.float32:
            tile = grp.swapper.tile if grp.swapper is not None else self.tile
            low_tile = torch.empty(min(tile, grp.numel), dtype=self.low_dtype)
        pending: dict[int, torch.Tensor] = {}  # masters spanning tiles, published at their last

        def update(t_lo: int, t_hi: int, states: dict[str, torch.Tensor]) -> None:
            master = states.pop(_MASTER, None)  # masters on NVMe: this tile's, swapped in
            grad = states.pop(_GRAD, None)  # and its gradients (See [Note: ZeRO-Infinity streaming])
            if grad is not None and scaled:
                grad.mul_(grad_scale)
            for lo, hi, step, _ in runs:
                a, b = max(lo, t_lo), min(hi, t_hi)
                if a >= b:
                    continue
                m = grp.master[a:b] if master is None else master[a - t_lo : b - t_lo]
                low = grp.low[a:b] if grp.low is not None else None
                if low_tile is not None:
                    low = low_tile[a - t_lo : b - t_lo]
                fp32_low = low is not None and low.dtype == torch.float32
                kernel.step(
                    m,
                    grp.grad[a:b] if grad is None else grad[a - t_lo : b - t_lo],
                    {k: v[a - t_lo : b - t_lo] for k, v in states.items()},
                    step=step,
                    lr=hp["lr"],
                    low_precision_out=None if low is None or fp32_low else low,
                )
                if fp32_low:
                    low.copy_(m)
            if self.masters_on_nvme:  # hand the new weights on now: no host copy is kept
                out = master if low_tile is None else low_tile[: t_hi - t_lo]
                self._publish_tile(grp, t_lo, out, publish, pending)
            elif grp.device_low is not None:  # overlap the copy-back with the next tile
                src = grp.low if grp.low is not None else grp.master
                grp.device_low[t_lo:t_hi].copy_(src[t_lo:t_hi], non_blocking=True)

        if grp.swapper is not None:
            grp.swapper.run(update)
        else:
            for t_lo in range(0, grp.numel, self.tile):
                t_hi = min(grp.numel, t_lo + self.tile)
                update(t_lo, t_hi, {k: v[t_lo:t_hi] for k, v in grp.states.items()})

    def updated(self, master: torch.Tensor) -> torch.Tensor:
        """The updated weights of ``master`` in the training dtype, on the compute device (flat);
        a master not offloaded (ratio < 1) is its own (See [Note: optimizer offload seam])."""
        if id(master) not in self._where:
            return master.detach()
        if self.masters_on_nvme:
            raise RuntimeError(
                "OptimizerOffload.updated: with the masters on NVMe no host copy of the updated weights "
                "is kept; they are handed to step(publish=...) (See [Note: ZeRO-Infinity streaming])"
            )
        g, i = self._where[id(master)]
        grp = self.groups[g]
        src = (
            grp.device_low if grp.device_low is not None else (grp.low if grp.low is not None else grp.master)
        )
        return src[grp.offsets[i] : grp.offsets[i + 1]]
