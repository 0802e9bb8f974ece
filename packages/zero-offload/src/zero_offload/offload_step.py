"""The CPU Adam step of ``OptimizerOffload`` (a mixin): tiles, fused low-precision cast, copy-back.

``step`` runs zero-ops' CPUAdam over ``sub_group_size`` tiles of every staged master (host
buffers, or the NVMe tile pipeline of [Note: tile pipeline]), writes the updated weights in
the training dtype and, on CUDA, copies each finished tile back to the device while the next
one is computed; ``updated`` hands those weights to the strategies. The attributes used here
are set by ``OptimizerOffload.__init__`` / ``adopt`` / ``finalize``; see
[Note: optimizer offload hook] in optimizer_offload.py.
"""

from __future__ import annotations

import torch
from zero_ops.adam import CPUAdamKernel

from zero_offload.offload_groups import _MASTER, _adam_settings, _Group
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
    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float | torch.Tensor = 1.0) -> None:
        """One Adam step of every staged master, on the CPU (see [Note: optimizer offload hook]).

        ``grad_scale`` may be a device tensor (the engine's clip coefficient): it is brought to
        the host once here, where the update runs anyway."""
        if not self._finalized:
            self.finalize(optimizer)
        self.grads_landed.wait()  # the staged gradients have landed: See [Note: offload copies]
        self.copied_back.wait()  # the last step's weights have left the host buffers
        owner = {id(p): (gi, pg) for gi, pg in enumerate(optimizer.param_groups) for p in pg["params"]}
        for grp in self.groups:
            if not grp.params or id(grp.params[0]) not in owner:
                continue
            gi, pg = owner[id(grp.params[0])]
            hp = _adam_settings(optimizer, pg, gi)
            kernel = CPUAdamKernel(
                betas=hp["betas"],
                eps=hp["eps"],
                weight_decay=hp["weight_decay"],
                adamw_mode=hp["adamw_mode"],
                bias_correction=hp["bias_correction"],
                amsgrad=hp["amsgrad"],
            )
            runs = self._ranges(optimizer, grp)
            if not runs:
                continue
            if isinstance(grad_scale, torch.Tensor):
                grad_scale = grad_scale.to(grp.grad.device)  # one copy per step, not per range
            if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
                for lo, hi, _, _ in runs:
                    grp.grad[lo:hi].mul_(grad_scale)

            def update(
                t_lo: int,
                t_hi: int,
                states: dict[str, torch.Tensor],
                grp=grp,
                runs=runs,
                kernel=kernel,
                hp=hp,
            ) -> None:
                master = states.pop(_MASTER, None)  # masters on NVMe: this tile's, swapped in
                for lo, hi, step, _ in runs:
                    a, b = max(lo, t_lo), min(hi, t_hi)
                    if a >= b:
                        continue
                    m = grp.master[a:b] if master is None else master[a - t_lo : b - t_lo]
                    fp32_low = grp.low is not None and grp.low.dtype == torch.float32
                    kernel.step(
                        m,
                        grp.grad[a:b],
                        {k: v[a - t_lo : b - t_lo] for k, v in states.items()},
                        step=step,
                        lr=hp["lr"],
                        low_precision_out=None if grp.low is None or fp32_low else grp.low[a:b],
                    )
                    if fp32_low:
                        grp.low[a:b].copy_(m)
                if grp.device_low is not None:  # overlap the copy-back with the next tile
                    src = grp.low if grp.low is not None else grp.master
                    grp.device_low[t_lo:t_hi].copy_(src[t_lo:t_hi], non_blocking=True)

            if grp.swapper is not None:
                grp.swapper.run(update)
            else:
                for t_lo in range(0, grp.numel, self.tile):
                    t_hi = min(grp.numel, t_lo + self.tile)
                    update(t_lo, t_hi, {k: v[t_lo:t_hi] for k, v in grp.states.items()})
            for _, _, step, params in runs:
                for p in params:
                    optimizer.state[p]["step"].fill_(float(step))
        self._staged.clear()
        self.copied_back.mark()  # the next host write of these buffers waits for it

    def updated(self, master: torch.Tensor) -> torch.Tensor:
        """The updated weights of ``master`` in the training dtype, on the compute device (flat);
        a master not offloaded (ratio < 1) is its own (See [Note: optimizer offload seam])."""
        if id(master) not in self._where:
            return master.detach()
        g, i = self._where[id(master)]
        grp = self.groups[g]
        src = (
            grp.device_low if grp.device_low is not None else (grp.low if grp.low is not None else grp.master)
        )
        return src[grp.offsets[i] : grp.offsets[i + 1]]
